// Tries the official OpenAI and Anthropic Node SDKs, at default settings,
// against Caddy + llmbudget + bench/fakellm (see bench/sdk-try.sh).
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";

const base = process.env.CADDY_URL;
const results = [];
const report = (name, ok, detail) => { results.push({ name, ok }); console.log(`${ok ? "PASS" : "FAIL"} ${name}: ${detail}`); };

// 1. An exhausted 1 h token budget: the SDK call fails at once, with the SDK's
//    own rate-limit error naming the budget (no retry sleep).
{
  const client = new OpenAI({ apiKey: "sk-sdk-openai", baseURL: base + "/v1" });
  const ask = () => client.chat.completions.create({ model: "gpt-4o", max_tokens: 200, messages: [{ role: "user", content: "hi" }] });
  let admitted = 0, err;
  for (let i = 0; i < 20 && !err; i++) {
    try { await ask(); admitted++; } catch (e) { err = e; }
  }
  const start = Date.now();
  try { await ask(); err = null; } catch (e) { err = e; }
  const took = Date.now() - start;
  report("openai: exhausted budget fails fast", err instanceof OpenAI.RateLimitError && took < 2000 && /per_key/.test(err.message),
    `${admitted} admitted, then ${err?.constructor?.name} after ${took} ms: ${err?.message}`);
}

// 2. The naive stream loop indexes choices[0] on every chunk and runs to the end.
{
  const client = new OpenAI({ apiKey: "sk-sdk-stream", baseURL: base + "/v1" });
  let text = "", failure;
  try {
    const stream = await client.chat.completions.create({ model: "gpt-4o", max_tokens: 50, stream: true, messages: [{ role: "user", content: "count" }] });
    for await (const c of stream) text += c.choices[0].delta.content ?? "";
  } catch (e) { failure = e; }
  report("openai: naive c.choices[0].delta loop", !failure && text.length > 0, failure ? `${failure.constructor.name}: ${failure.message}` : `read ${text.length} chars`);
}

// 3. Anthropic SDK authenticating with x-api-key: a budget per key, with no
//    principal configured; its RateLimitError names the budget.
{
  const ask = (key) => new Anthropic({ apiKey: key, baseURL: base }).messages.create({ model: "claude-sonnet-4-6", max_tokens: 200, messages: [{ role: "user", content: "hi" }] });
  let admitted = 0, err;
  for (let i = 0; i < 20 && !err; i++) {
    try { await ask("sk-ant-one"); admitted++; } catch (e) { err = e; }
  }
  report("anthropic: exhausted key gets RateLimitError naming the budget", err instanceof Anthropic.RateLimitError && /per_key/.test(err.message),
    `${admitted} admitted, then ${err?.constructor?.name}: ${err?.message}`);
  let other;
  try { await ask("sk-ant-two"); } catch (e) { other = e; }
  report("anthropic: a never-used key has its own budget", !other, other ? `${other.constructor.name}: ${other.message}` : "admitted");
}

// 4. Streams cut at their output lease (LEASE_URL: a per-key 600-token budget
//    before an upstream that writes 3000 tokens; each check uses a key of its
//    own, so each has a whole window). A stream asking for 4096 tokens is
//    admitted with its lease and cut when an extension is refused: the SDKs
//    must read a finished answer that stopped at its length, not an error.
const lease = process.env.LEASE_URL;
const describe = (e) => `${e?.constructor?.name}: ${e?.message}`;
{
  // (a) the naive loop: no exception, the last chunk with a choice says "length".
  const client = new OpenAI({ apiKey: "sk-lease-naive", baseURL: lease + "/v1" });
  let text = "", finish, chunks = 0, failure;
  try {
    const stream = await client.chat.completions.create({ model: "gpt-4o", max_tokens: 4096, stream: true, messages: [{ role: "user", content: "write a lot" }] });
    for await (const c of stream) {
      chunks++;
      text += c.choices[0].delta.content ?? "";
      finish = c.choices[0].finish_reason ?? finish;
    }
  } catch (e) { failure = e; }
  report("openai lease: naive loop ends with finish_reason length", !failure && finish === "length" && text.length > 0,
    failure ? describe(failure) : `${chunks} chunks, ${text.length} chars, finish_reason ${finish}`);
}
{
  // (b) include_usage: the usage chunk (choices empty) follows the length chunk.
  const client = new OpenAI({ apiKey: "sk-lease-usage", baseURL: lease + "/v1" });
  const seen = [];
  let text = "", failure;
  try {
    const stream = await client.chat.completions.create({ model: "gpt-4o", max_tokens: 4096, stream: true, stream_options: { include_usage: true }, messages: [{ role: "user", content: "write a lot" }] });
    for await (const c of stream) {
      if (c.choices.length > 0) {
        text += c.choices[0].delta?.content ?? "";
        if (c.choices[0].finish_reason) seen.push(`finish:${c.choices[0].finish_reason}`);
      } else if (c.usage) seen.push("usage");
      else seen.push("empty");
    }
  } catch (e) { failure = e; }
  const ok = !failure && text.length > 0 && seen.join(",") === "finish:length,usage";
  report("openai lease: include_usage gets the usage chunk after the length chunk", ok,
    failure ? describe(failure) : `${text.length} chars, then ${seen.join(", ") || "nothing"}`);
}
{
  // (c) the stream helper's finalChatCompletion resolves with finish_reason length.
  const client = new OpenAI({ apiKey: "sk-lease-helper", baseURL: lease + "/v1" });
  let done, failure;
  try {
    const stream = client.chat.completions.stream({ model: "gpt-4o", max_tokens: 4096, messages: [{ role: "user", content: "write a lot" }] });
    done = await stream.finalChatCompletion();
  } catch (e) { failure = e; }
  const choice = done?.choices?.[0];
  report("openai lease: stream().finalChatCompletion() resolves, finish_reason length",
    !failure && choice?.finish_reason === "length" && (choice?.message?.content ?? "").length > 0,
    failure ? describe(failure) : `finish_reason ${choice?.finish_reason}, ${choice?.message?.content?.length ?? 0} chars`);
}
{
  // (d) Anthropic's messages.stream().finalMessage(): stop_reason max_tokens.
  const client = new Anthropic({ apiKey: "sk-ant-lease-final", baseURL: lease });
  let msg, failure;
  try {
    const stream = client.messages.stream({ model: "claude-sonnet-4-6", max_tokens: 4096, messages: [{ role: "user", content: "write a lot" }] });
    msg = await stream.finalMessage();
  } catch (e) { failure = e; }
  const text = (msg?.content ?? []).filter((b) => b.type === "text").map((b) => b.text).join("");
  report("anthropic lease: stream().finalMessage() resolves, stop_reason max_tokens", !failure && msg?.stop_reason === "max_tokens" && text.length > 0,
    failure ? describe(failure) : `stop_reason ${msg?.stop_reason}, ${text.length} chars, usage ${JSON.stringify(msg?.usage)}`);
}
{
  // (e) Anthropic raw events: message_delta (max_tokens), then message_stop, last.
  const client = new Anthropic({ apiKey: "sk-ant-lease-raw", baseURL: lease });
  const events = [];
  let stop, failure;
  try {
    const stream = await client.messages.create({ model: "claude-sonnet-4-6", max_tokens: 4096, stream: true, messages: [{ role: "user", content: "write a lot" }] });
    for await (const ev of stream) {
      events.push(ev.type);
      if (ev.type === "message_delta") stop = ev.delta.stop_reason;
    }
  } catch (e) { failure = e; }
  const tail = events.slice(-3).join(",");
  report("anthropic lease: raw events end content_block_stop, message_delta max_tokens, message_stop",
    !failure && tail === "content_block_stop,message_delta,message_stop" && stop === "max_tokens" && events.includes("content_block_delta"),
    failure ? describe(failure) : `${events.length} events, last ${tail}, stop_reason ${stop}`);
}

// (f) Responses: the stream helper's finalResponse() takes the response
//     object the cut stream ends with: status incomplete, reason
//     max_output_tokens, and its output_text is the text the deltas brought.
{
  const client = new OpenAI({ apiKey: "sk-lease-responses", baseURL: lease + "/v1" });
  let deltas = "", final, failure;
  try {
    const stream = client.responses.stream({ model: "gpt-4o", max_output_tokens: 4096, input: "write a long story" });
    stream.on("response.output_text.delta", (e) => { deltas += e.delta; });
    final = await stream.finalResponse();
  } catch (e) { failure = e; }
  report("openai lease: responses.stream().finalResponse() resolves incomplete, with the text streamed",
    !failure && final.status === "incomplete" && final.incomplete_details?.reason === "max_output_tokens" && deltas.length > 0 && final.output_text === deltas,
    failure ? describe(failure) : `status ${final.status} (${final.incomplete_details?.reason}), output_text ${final.output_text.length} chars, deltas ${deltas.length} chars`);
}

// (g) fleetlimit in front of the APIs: the second request of a key is refused
//     with the API's own rate-limit error, which each SDK raises as its
//     RateLimitError with a message naming the zone, at once (the wait is
//     long: x-should-retry false).
{
  const rate = process.env.RATE_URL;
  const openai = new OpenAI({ apiKey: "sk-rate-openai", baseURL: rate + "/v1" });
  const askOpenAI = () => openai.chat.completions.create({ model: "gpt-4o", max_tokens: 20, messages: [{ role: "user", content: "hi" }] });
  let err;
  try { await askOpenAI(); await askOpenAI(); } catch (e) { err = e; }
  report("openai: a fleetlimit 429 is a RateLimitError naming the zone", err instanceof OpenAI.RateLimitError && /per_key_rate/.test(err.message),
    `${err?.constructor?.name}: ${err?.message}`);
  const anthropic = new Anthropic({ apiKey: "sk-rate-claude", baseURL: rate });
  const askClaude = () => anthropic.messages.create({ model: "claude-sonnet-4-6", max_tokens: 20, messages: [{ role: "user", content: "hi" }] });
  err = undefined;
  try { await askClaude(); await askClaude(); } catch (e) { err = e; }
  report("anthropic: a fleetlimit 429 is a RateLimitError naming the zone", err instanceof Anthropic.RateLimitError && /per_key_rate/.test(err.message),
    `${err?.constructor?.name}: ${err?.message}`);
}

// (h) An exhausted dollar budget reads as the provider's own exhausted
//     quota: OpenAI's SDK raises RateLimitError (429 insufficient_quota),
//     Anthropic's its RateLimitError, each naming the budget, at once.
{
  const usd = process.env.USD_URL;
  const openai = new OpenAI({ apiKey: "sk-usd-openai", baseURL: usd + "/v1" });
  let err;
  for (let i = 0; i < 20 && !err; i++) {
    try { await openai.chat.completions.create({ model: "gpt-4o", max_tokens: 20, messages: [{ role: "user", content: "hi" }] }); } catch (e) { err = e; }
  }
  report("openai: an exhausted dollar budget is a RateLimitError (insufficient_quota)", err instanceof OpenAI.RateLimitError && err.code === "insufficient_quota" && /per_key_usd/.test(err.message),
    `${err?.constructor?.name} ${err?.code}: ${err?.message}`);
  const anthropic = new Anthropic({ apiKey: "sk-usd-claude", baseURL: usd });
  err = undefined;
  for (let i = 0; i < 20 && !err; i++) {
    try { await anthropic.messages.create({ model: "claude-sonnet-4-6", max_tokens: 20, messages: [{ role: "user", content: "hi" }] }); } catch (e) { err = e; }
  }
  report("anthropic: an exhausted dollar budget is a RateLimitError", err instanceof Anthropic.RateLimitError && /per_key_usd/.test(err.message),
    `${err?.constructor?.name}: ${err?.message}`);
}

// 8. The Responses API's WebSocket mode through llmbudget, with the official
//    SDK's ResponsesWS (per_key, 1000 tokens; answers of 70): each
//    response.create is budgeted and settled; one that does not fit gets an
//    error event naming the budget, and the socket stays open for the next.
{
  const { ResponsesWS } = await import("openai/resources/responses/ws");
  const client = new OpenAI({ apiKey: "sk-sdk-socket", baseURL: base + "/v1" });
  const rws = new ResponsesWS(client);
  const outcome = () => new Promise((resolve) => {
    const done = (kind, detail) => { rws.off("response.completed", onDone); rws.off("error", onError); resolve({ kind, detail }); };
    const onDone = (ev) => done("completed", ev.response?.usage);
    const onError = (err) => done("error", err.error ?? err.message);
    rws.on("response.completed", onDone);
    rws.on("error", onError);
  });
  let completed = 0, refusal, text = "";
  rws.on("response.output_text.delta", (ev) => { text += ev.delta; });
  for (let i = 0; i < 20 && !refusal; i++) {
    const next = outcome();
    rws.send({ type: "response.create", model: "gpt-4o", input: "hi", max_output_tokens: 200 });
    const o = await next;
    if (o.kind === "completed") completed++; else refusal = o.detail;
  }
  const again = outcome();
  rws.send({ type: "response.create", model: "gpt-4o", input: "hi", max_output_tokens: 200 });
  const second = await again;
  rws.close();
  report("openai socket: ResponsesWS responses are budgeted, a refusal is an error event on the open socket",
    completed > 0 && text.length > 0 && refusal?.status === 429 && /per_key/.test(refusal?.error?.message ?? "") && second.kind === "error",
    `${completed} completed (${text.length} chars), then ${JSON.stringify(refusal)?.slice(0, 200)}; the next on the same socket: ${second.kind}`);
}

// 9. The Realtime API through llmbudget, with the official SDK's
//    OpenAIRealtimeWS (a budget of 30,000 tokens; each response held at the
//    window of 20,000 and the cap of 4,096; answers of 70 audio tokens):
//    responses are served and settled until the budget is spent, then a
//    response.create gets an error event naming the budget, and the session
//    stays open.
{
  const { OpenAIRealtimeWS } = await import("openai/realtime/ws");
  const client = new OpenAI({ apiKey: "sk-sdk-realtime", baseURL: process.env.REALTIME_URL + "/v1" });
  // The SDK dials wss: only; the site's certificate is Caddy's internal CA.
  const rt = new OpenAIRealtimeWS({ model: "gpt-realtime", options: { rejectUnauthorized: false } }, client);
  await new Promise((resolve, reject) => { rt.socket.on("open", resolve); rt.socket.on("error", reject); });
  const outcome = () => new Promise((resolve) => {
    const done = (kind, detail) => { rt.off("response.done", onDone); rt.off("error", onError); resolve({ kind, detail }); };
    const onDone = (ev) => done("done", ev.response?.usage);
    const onError = (err) => done("error", err.error ?? err.message);
    rt.on("response.done", onDone);
    rt.on("error", onError);
  });
  let answered = 0, audio = 0, refusal;
  rt.on("response.output_audio.delta", () => { audio++; });
  rt.send({ type: "session.update", session: { type: "realtime", audio: { input: { turn_detection: null } } } });
  for (let i = 0; i < 400 && !refusal; i++) {
    const next = outcome();
    rt.send({ type: "conversation.item.create", item: { type: "message", role: "user", content: [{ type: "input_text", text: "hi" }] } });
    rt.send({ type: "response.create" });
    const o = await next;
    if (o.kind === "done") answered++; else refusal = o;
  }
  const again = outcome();
  rt.send({ type: "response.create" });
  const second = await again;
  rt.close();
  report("openai realtime: OpenAIRealtimeWS responses are budgeted, a refusal is an error event on the open session",
    answered > 0 && audio > 0 && /realtime/.test(JSON.stringify(refusal?.detail ?? "")) && second.kind === "error",
    `${answered} answered (${audio} audio deltas), then ${JSON.stringify(refusal?.detail)?.slice(0, 200)}; the next on the same session: ${second.kind}`);
}

// 10. Gemini Live through llmbudget, with the official @google/genai SDK's
//     ai.live.connect (a budget of 30,000 tokens; each turn held at the
//     window of 20,000, the cap of 4,096 forwarded in the setup and the
//     thinking it allows, 0 here): turns are answered and settled until the
//     budget is spent, then the session ends with a close frame naming it.
{
  const { GoogleGenAI, Modality } = await import("@google/genai");
  const ai = new GoogleGenAI({ apiKey: "sdk-live-key", httpOptions: { baseUrl: process.env.LIVE_URL } });
  let turns = 0, audio = 0, closed, settle;
  const session = await ai.live.connect({
    model: "gemini-2.0-flash-live-001",
    config: { responseModalities: [Modality.AUDIO], thinkingConfig: { thinkingBudget: 0 },
      realtimeInputConfig: { automaticActivityDetection: { disabled: true } } },
    callbacks: {
      onmessage: (m) => { if (m.serverContent?.modelTurn) audio++; if (m.serverContent?.turnComplete) settle?.("turn"); },
      onclose: (e) => { closed = `${e.code} ${e.reason}`; settle?.("close"); },
    },
  });
  for (let i = 0; i < 400 && !closed; i++) {
    const next = new Promise((resolve) => { settle = resolve; });
    session.sendClientContent({ turns: [{ role: "user", parts: [{ text: "hi" }] }], turnComplete: true });
    if (await next === "turn") turns++;
  }
  report("google live: ai.live.connect turns are budgeted, a refusal closes the session naming the budget",
    turns > 0 && audio > 0 && /^1008 RESOURCE_EXHAUSTED \(token_budget_exceeded\)/.test(closed ?? ""),
    `${turns} turns (${audio} audio messages), then close ${closed}`);
}

process.exit(results.every((r) => r.ok) ? 0 : 1);

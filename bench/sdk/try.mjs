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

process.exit(results.every((r) => r.ok) ? 0 : 1);

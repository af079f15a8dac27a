// Generates the synthetic corpora (JSON, logs, numbers, random base64/hex,
// random punctuation) deterministically: node bench/tokenbound/gen.mjs
import { writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
const dir = join(dirname(fileURLToPath(import.meta.url)), 'corpus');
let s = 0x9e3779b9;
const rnd = () => { s ^= s << 13; s >>>= 0; s ^= s >>> 17; s ^= s << 5; s >>>= 0; return s / 4294967296; };
const pick = (a) => a[Math.floor(rnd() * a.length)];
const int = (lo, hi) => lo + Math.floor(rnd() * (hi - lo + 1));

// JSON: an API response a model might emit.
const names = ['alice', 'bob', 'carol', 'dave', 'erin', 'frank', 'grace', 'heidi'];
const cities = ['Lisbon', 'Osaka', 'Denver', 'Nairobi', 'Oslo', 'Lima', 'Perth', 'Austin'];
const users = [];
for (let i = 0; i < 18; i++) {
  users.push({
    id: 1000 + i, username: pick(names) + int(1, 99), email: `${pick(names)}@example.com`,
    active: rnd() < 0.7, score: Math.round(rnd() * 10000) / 100, city: pick(cities),
    tags: [pick(['admin', 'beta', 'staff', 'trial']), pick(['eu', 'us', 'apac'])],
    created_at: `2024-${String(int(1, 12)).padStart(2, '0')}-${String(int(1, 28)).padStart(2, '0')}T${String(int(0, 23)).padStart(2, '0')}:${String(int(0, 59)).padStart(2, '0')}:00Z`,
  });
}
writeFileSync(join(dir, 'json.json'), JSON.stringify({ page: 1, per_page: 18, total: 342, users }, null, 2) + '\n');

// Shell output / logs.
const lv = ['INFO', 'INFO', 'INFO', 'DEBUG', 'WARN', 'ERROR'];
const msgs = ['request completed', 'cache miss', 'upstream timeout', 'retrying connection', 'TLS handshake ok', 'config reloaded'];
let log = '$ kubectl get pods -n prod\nNAME                          READY   STATUS    RESTARTS   AGE\n';
for (let i = 0; i < 8; i++) log += `api-${(int(0, 0xffffff)).toString(16).padStart(6, '0')}-${(int(0, 0xfffff)).toString(36)}   1/1     ${pick(['Running', 'Running', 'Pending', 'CrashLoopBackOff'])}   ${int(0, 9)}          ${int(1, 59)}m\n`;
log += '\n$ journalctl -u gateway --since "10 min ago"\n';
for (let i = 0; i < 30; i++) {
  log += `2024-11-0${int(1, 9)}T12:${String(int(0, 59)).padStart(2, '0')}:${String(int(0, 59)).padStart(2, '0')}.${String(int(0, 999)).padStart(3, '0')}Z ${pick(lv)} gateway[${int(1000, 9999)}]: ${pick(msgs)} method=${pick(['GET', 'POST', 'PUT'])} path=/v1/${pick(['users', 'orders', 'items'])}/${int(1, 99999)} status=${pick([200, 200, 201, 404, 500, 502])} duration_ms=${(rnd() * 900).toFixed(2)} remote=10.${int(0, 255)}.${int(0, 255)}.${int(0, 255)}:${int(1024, 65535)}\n`;
}
log += '\n$ df -h\nFilesystem      Size  Used Avail Use% Mounted on\n/dev/nvme0n1p2  468G  301G  144G  68% /\ntmpfs            16G  2.1M   16G   1% /run\n';
writeFileSync(join(dir, 'logs.txt'), log);

// Numbers and dates heavy text.
let num = 'Quarterly figures (all amounts in USD):\n';
for (let i = 0; i < 40; i++) {
  num += `On ${pick(['Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun'])} ${int(1, 28)}, ${int(1990, 2025)} revenue was $${int(1, 999)},${String(int(0, 999)).padStart(3, '0')}.${String(int(0, 99)).padStart(2, '0')} (${(rnd() * 40 - 20).toFixed(1)}% YoY), units ${int(100, 99999)}, ratio ${(rnd() * 3).toFixed(4)}, ID ${int(100000000, 999999999)}, at ${String(int(0, 23)).padStart(2, '0')}:${String(int(0, 59)).padStart(2, '0')} on 20${int(10, 25)}-${String(int(1, 12)).padStart(2, '0')}-${String(int(1, 28)).padStart(2, '0')}; lat ${(rnd() * 180 - 90).toFixed(6)}, lon ${(rnd() * 360 - 180).toFixed(6)}.\n`;
}
writeFileSync(join(dir, 'numbers_dates.txt'), num);

// Adversarial: random base64 and hex.
const b64 = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/';
let a = '';
for (let l = 0; l < 40; l++) { for (let i = 0; i < 76; i++) a += pick(b64); a += '\n'; }
writeFileSync(join(dir, 'adv_base64.txt'), a);
let h = '';
for (let l = 0; l < 40; l++) { for (let i = 0; i < 64; i++) h += pick('0123456789abcdef'); h += '\n'; }
writeFileSync(join(dir, 'adv_hex.txt'), h);
// Adversarial: random printable ASCII punctuation.
const punct = '!"#$%&\'()*+,-./:;<=>?@[\\]^_`{|}~';
let p = '';
for (let l = 0; l < 40; l++) { for (let i = 0; i < 72; i++) p += pick(punct); p += '\n'; }
writeFileSync(join(dir, 'adv_punct.txt'), p);

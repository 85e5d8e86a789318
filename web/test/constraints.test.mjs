// WebGenerator with a constraint (src/constraints.js on xgrammar), on a stand-in model whose every step is a
// seeded random row of log-probs (as random weights give): every output is a sentence of its language, the
// end token only where the grammar accepts, finish "stop" when the grammar is complete, bad constraints in one
// line. TOKENIZER=path/to/tokenizer.json (any GPT-2 tokenizer.json).
//   TOKENIZER=... node --test test/constraints.test.mjs
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { Tokenizer } from "@huggingface/tokenizers";

import "./xgrammar-node.mjs";
import { Constraint, ConstraintError, ebnfLiteral } from "../src/constraints.js";
import { GenerationError, WebGenerator } from "../src/generator.js";

const tokenizerPath = process.env.TOKENIZER;
const skip = !tokenizerPath;

/** Log-probs from a seeded generator: flat-ish random rows, `eosBoost` added to the end token's score. */
class RandomLM {
  constructor(vocab, seed, eosId, eosBoost = 0) {
    Object.assign(this, { vocabSize: vocab, nPositions: 256, seed, eosId, eosBoost });
  }
  start() {
    this.state = (this.seed++ * 2654435761 + 1) >>> 0 || 1;
  }
  async forward() {
    const row = new Float32Array(this.vocabSize);
    let x = this.state; // xorshift32: cheap (the sampler's own draws stay rng.js's)
    for (let i = 0; i < row.length; i++) {
      x ^= x << 13;
      x ^= x >>> 17;
      x ^= x << 5;
      row[i] = -12 + 4 * ((x >>> 0) / 4294967296);
    }
    this.state = x >>> 0 || 1;
    row[this.eosId] += this.eosBoost;
    return row;
  }
  release() {}
}

let shared = null;
function generator(eosBoost = 0) {
  const json = JSON.parse(readFileSync(tokenizerPath, "utf8"));
  const tok = new Tokenizer(json, {});
  const eos = json.added_tokens.find((a) => a.content === "<|endoftext|>")?.id ?? 0;
  const vocab = Object.keys(json.model.vocab).length + json.added_tokens.length + 7; // rows past the tokenizer's
  const gen = new WebGenerator({ manifest: {} }, tok, new RandomLM(vocab, 1, eos, eosBoost), { eos_token_id: eos }, json);
  if (shared) gen.engine = shared; // one xgrammar engine for the file's tests (its vocabulary takes ~0.1 s)
  return gen;
}

async function run(gen, prompt, options) {
  const it = gen.stream(prompt, options);
  for (;;) {
    const { value, done } = await it.next();
    if (done) return value;
  }
}

const SCHEMA = {
  type: "object",
  properties: { name: { type: "string", maxLength: 8 }, age: { type: "integer", minimum: 0, maximum: 150 }, ok: { type: "boolean" }, tags: { type: "array", items: { enum: ["a", "b"] }, maxItems: 3 } },
  required: ["name", "age", "ok", "tags"],
  additionalProperties: false,
};

function validRecord(v) {
  return typeof v.name === "string" && v.name.length <= 8 && Number.isInteger(v.age) && v.age >= 0 && v.age <= 150 && typeof v.ok === "boolean" &&
    Array.isArray(v.tags) && v.tags.length <= 3 && v.tags.every((t) => t === "a" || t === "b") && Object.keys(v).length === 4;
}

test("every sampled output of a JSON Schema parses and validates", { skip }, async () => {
  const gen = generator();
  shared = gen.engine;
  let stops = 0;
  for (let i = 0; i < 12; i++) {
    const r = await run(gen, "A record:", { max_new_tokens: 120, temperature: 1.0, top_k: 0, seed: i, constraint: { json_schema: SCHEMA } });
    shared = gen.engine;
    if (r.finish_reason === "length") continue;
    stops++;
    assert.equal(r.finish_reason, "stop", r.text);
    assert.ok(validRecord(JSON.parse(r.text)), r.text);
    assert.ok(!/\s/.test(r.text.replace(/"(?:[^"\\]|\\.)*"/g, '""')), `compact JSON: no whitespace outside strings: ${r.text}`);
  }
  assert.ok(stops >= 8, `only ${stops} of 12 outputs closed within 120 tokens`);
});

test("regex, choice, GBNF and any JSON object: every output is in the language", { skip }, async () => {
  const gen = generator();
  const cases = [
    [{ regex: "[0-9]{4}-[0-9]{2}-[0-9]{2}" }, (t) => /^[0-9]{4}-[0-9]{2}-[0-9]{2}$/.test(t)],
    [{ choice: ["yes", "no", " maybe so"] }, (t) => ["yes", "no", " maybe so"].includes(t)],
    [{ grammar: 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?' }, (t) => /^\([1-9][0-9]?(\+[1-9][0-9]?)*\)$/.test(t)],
    [{ json_object: true }, (t) => { const v = JSON.parse(t); return v !== null && typeof v === "object" && !Array.isArray(v); }],
  ];
  for (const [constraint, ok] of cases) {
    for (let i = 0; i < 6; i++) {
      const r = await run(gen, "Answer:", { max_new_tokens: 60, temperature: 1.0, top_k: 0, seed: i, constraint });
      if (r.finish_reason === "length") continue;
      assert.ok(ok(r.text), `${JSON.stringify(constraint)} gave ${JSON.stringify(r.text)} (${r.finish_reason})`);
    }
  }
  shared = gen.engine;
});

test("the end token only where the grammar accepts: eos after an open-ended match, never inside", { skip }, async () => {
  const gen = generator(14); // the model wants to end at every step
  const r = await run(gen, "n:", { max_new_tokens: 20, temperature: 0, constraint: { regex: "[0-9]+" } });
  assert.equal(r.finish_reason, "eos");
  assert.ok(r.token_ids.length >= 2); // a digit first: the end token is refused on the empty text
  assert.match(gen.decode(r.token_ids), /^[0-9]+$/);
  const free = await run(gen, "n:", { max_new_tokens: 20, temperature: 0 });
  assert.equal(free.token_ids.length, 1); // unconstrained, it ends at once
  const none = await run(gen, "n:", { max_new_tokens: 6, temperature: 0, ignore_eos: true, constraint: { regex: "[0-9]+" } });
  assert.equal(none.finish_reason, "length"); // ignore_eos: the end token is never allowed
  shared = gen.engine;
});

test("a complete grammar ends the row with finish stop; max_new_tokens inside it is length", { skip }, async () => {
  const gen = generator();
  const r = await run(gen, "x", { max_new_tokens: 30, temperature: 0, constraint: { choice: ["alpha beta gamma"] } });
  assert.equal(r.finish_reason, "stop");
  assert.equal(r.text, "alpha beta gamma");
  const cut = await run(gen, "x", { max_new_tokens: 1, temperature: 0, constraint: { choice: ["alpha beta gamma"] } });
  assert.equal(cut.finish_reason, "length");
  assert.ok("alpha beta gamma".startsWith(cut.text) && cut.text.length < 16);
  shared = gen.engine;
});

test("bad constraints are one-line GenerationErrors, before any step", { skip }, async () => {
  const gen = generator();
  const bad = [
    [{ lark: 'start: "a"' }, /Lark grammar needs the Python runtime.*GBNF/],
    [{ json_schema: "{not json" }, /not valid JSON/],
    [{ json_schema: "[1]" }, /is an object/],
    [{ regex: "(" }, /regex constraint is refused by the engine/],
    [{ regex: "(?=a)a" }, /uses look-around/],
    [{ regex: "(a)\\1" }, /uses a back-reference/],
    [{ grammar: "root ::= (" }, /gbnf constraint is refused by the engine/],
    [{ regex: "a", choice: ["b"] }, /Give one constraint/],
    [{ choice: [] }, /non-empty list/],
    [{ json_schema: { type: "number", maximum: 1 } }, /xgrammar 0\.1\.27\) bounds numbers wrongly/],
    [{ json_schema: { type: "integer", minimum: 0, maximum: 1e6 } }, /more than 4096 integers/],
    [{ json_schema: "[".repeat(200) + "]".repeat(200) }, /nests 200 levels deep/],
    [{ regex: "x".repeat(300 * 1024) }, /the limit is 262144/],
  ];
  for (const [constraint, message] of bad) {
    await assert.rejects(run(gen, "x", { max_new_tokens: 4, constraint }), (e) => e instanceof GenerationError && message.test(e.message) && !e.message.includes("\n"), JSON.stringify(constraint).slice(0, 80));
  }
  assert.throws(() => Constraint.from("regex"), ConstraintError);
  assert.equal(ebnfLiteral('a"\\\n☃😀'), '"a\\"\\\\\\u000a\\u2603\\U0001f600"');
  shared = gen.engine;
});

test("a repeated constraint compiles once (the engine's cache)", { skip }, async () => {
  const gen = generator();
  const engine = await gen.engine;
  const a = await engine.compile(Constraint.regex("[a-z]{3}"));
  const b = await engine.compile({ regex: "[a-z]{3}" });
  assert.equal(a, b);
});

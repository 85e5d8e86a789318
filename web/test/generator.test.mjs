// WebGenerator's loop with a stand-in model (no onnxruntime): Stop (an AbortSignal), EOS, stop strings and
// the length rule. TOKENIZER=path/to/tokenizer.json (any GPT-2 tokenizer.json).
//   TOKENIZER=... node --test test/generator.test.mjs
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { Tokenizer } from "@huggingface/tokenizers";

import { GenerationError, WebGenerator } from "../src/generator.js";

const tokenizerPath = process.env.TOKENIZER;

/** A model whose next token is always `next(step)`: log-prob 0 for it, -10 for the rest. */
class FakeLM {
  constructor(vocab, next) {
    Object.assign(this, { vocabSize: vocab, nPositions: 64, next, step: 0, capacity: 0 });
  }
  start(capacity) {
    this.capacity = capacity;
    this.step = 0;
  }
  async forward() {
    const row = new Float32Array(this.vocabSize).fill(-10);
    row[this.next(this.step++)] = 0;
    return row;
  }
  release() {}
}

function generator(next, defaults = { eos_token_id: 0 }) {
  const json = JSON.parse(readFileSync(tokenizerPath, "utf8"));
  const tok = new Tokenizer(json, {});
  const vocab = Object.keys(json.model.vocab).length;
  return new WebGenerator({ manifest: {} }, tok, new FakeLM(vocab, next), defaults);
}

async function run(gen, prompt, options, signal, onStep = () => {}) {
  const it = gen.stream(prompt, options, signal);
  for (;;) {
    const { value, done } = await it.next();
    if (done) return value;
    onStep(value);
  }
}

test("Stop ends the generation after the current token", { skip: !tokenizerPath }, async () => {
  const gen = generator((s) => 10 + (s % 5));
  const controller = new AbortController();
  let n = 0;
  const r = await run(gen, "hi", { max_new_tokens: 50, temperature: 0 }, controller.signal, () => {
    if (++n === 3) controller.abort();
  });
  assert.equal(r.finish_reason, "stopped");
  assert.equal(r.token_ids.length, 4); // the token after the click is the last one
  assert.equal(r.text, gen.decode(r.token_ids));
});

test("EOS ends the generation and stays in token_ids; ignore_eos goes on", { skip: !tokenizerPath }, async () => {
  const gen = generator((s) => (s === 2 ? 0 : 20));
  const r = await run(gen, "hi", { max_new_tokens: 10, temperature: 0 });
  assert.equal(r.finish_reason, "eos");
  assert.deepEqual(r.token_ids, [20, 20, 0]);
  const all = await run(gen, "hi", { max_new_tokens: 10, temperature: 0, ignore_eos: true });
  assert.equal(all.finish_reason, "length");
  assert.equal(all.token_ids.length, 10);
});

test("a stop string split over tokens is cut and never streamed", { skip: !tokenizerPath }, async () => {
  const gen = generator((s) => [30, 31, 32, 33, 34, 35][s % 6]);
  const full = gen.decode([30, 31, 32, 33, 34, 35]);
  const stop = full.slice(2, 5);
  const r = await run(gen, "hi", { max_new_tokens: 6, temperature: 0, stop: [stop] });
  assert.equal(r.finish_reason, "stop");
  assert.equal(r.text, full.slice(0, full.indexOf(stop)));
  assert.equal(r.pieces.join(""), r.text);
});

test("a prompt longer than the context is refused before any work", { skip: !tokenizerPath }, async () => {
  const gen = generator(() => 5);
  await assert.rejects(run(gen, " hello".repeat(100), { max_new_tokens: 8 }), (e) => e instanceof GenerationError && /positions/.test(e.message));
  await assert.rejects(run(gen, "hi", { temperature: -1 }), /temperature/);
});

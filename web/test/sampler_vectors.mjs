// Run the JS sampler on shared test vectors (written by tests/web/test_web_sampler.py from the NumPy sampler):
//   node test/sampler_vectors.mjs IN.json OUT.json
// Each case: {row, params, seen, seed, draws}; the output per case: the kept ids and their probabilities after
// the repetition penalty and the warpers, the greedy id, and `draws` tokens drawn with one generator; with
// `allowed` (a constraint's allowed ids), the greedy id and the draws with that mask (nextToken's `allowed`).
import { readFileSync, writeFileSync } from "node:fs";

import { defaultRng } from "../src/rng.js";
import { applyRepetitionPenalty, argmax, nextToken, SamplingParams, warpRow } from "../src/sampler.js";

const [input, output] = process.argv.slice(2);
const { cases, uniforms } = JSON.parse(readFileSync(input, "utf8"));
const out = { cases: [], uniforms: {} };
for (const c of cases) {
  const row = Float32Array.from(c.row);
  const params = new SamplingParams({ ...c.params, do_sample: true });
  const scores = applyRepetitionPenalty(row, c.seen, params.repetition_penalty);
  const { ids, probs } = warpRow(scores, params);
  const rng = defaultRng(c.seed);
  const draws = Array.from({ length: c.draws }, () => nextToken(row, params, c.seen, rng));
  const result = {
    ids: ids === null ? Array.from(probs.keys()) : Array.from(ids),
    probs: Array.from(probs),
    greedy: argmax(scores),
    draws,
  };
  if (c.allowed) {
    const mask = new Uint8Array(row.length);
    for (const t of c.allowed) mask[t] = 1;
    const masked = defaultRng(c.seed);
    result.masked_draws = Array.from({ length: c.draws }, () => nextToken(row, params, c.seen, masked, mask));
    const greedy = new SamplingParams({ ...c.params, do_sample: false });
    result.masked_greedy = nextToken(row, greedy, c.seen, null, mask);
  }
  out.cases.push(result);
}
for (const seed of uniforms.seeds) {
  const rng = defaultRng(BigInt(seed));
  out.uniforms[seed] = Array.from({ length: uniforms.n }, () => rng.random());
}
writeFileSync(output, JSON.stringify(out));

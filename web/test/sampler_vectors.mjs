// Run the JS sampler on shared test vectors (written by tests/test_web_sampler.py from the NumPy sampler):
//   node test/sampler_vectors.mjs IN.json OUT.json
// Each case: {row, params, seen, seed, draws}; the output per case: the kept ids and their probabilities after
// the repetition penalty and the warpers, the greedy id, and `draws` tokens drawn with one generator.
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
  out.cases.push({
    ids: ids === null ? Array.from(probs.keys()) : Array.from(ids),
    probs: Array.from(probs),
    greedy: argmax(scores),
    draws,
  });
}
for (const seed of uniforms.seeds) {
  const rng = defaultRng(BigInt(seed));
  out.uniforms[seed] = Array.from({ length: uniforms.n }, () => rng.random());
}
writeFileSync(output, JSON.stringify(out));

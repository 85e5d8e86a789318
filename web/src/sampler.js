// Next-token selection as small pure functions, the same arithmetic as gpt2edge.runtime.decoding.sampling (NumPy),
// which follows transformers' logits processors: repetition penalty, then (when sampling) temperature, top-k,
// top-p, min-p, and one uniform from the seeded generator (rng.js) by inverse CDF.
//
// Scores are float32 (Math.fround after every float32 operation); sums that NumPy accumulates in float64 are
// accumulated in float64 in NumPy's order (pairwiseSum), so the kept sets match and probabilities agree within
// float32 rounding of exp (1e-6), and a seed draws the token NumPy draws.
//
// A warper works on one row's surviving tokens as {ids, vals}: ids null means every token of the row.

import { defaultRng } from "./rng.js";

const f32 = Math.fround;
const SMALL_DRAW = 4096; // sample_index draws rows up to this long from one cumulative sum
const BLOCK = 1024; // ... and longer ones block by block
const PW_BLOCKSIZE = 128; // NumPy's pairwise summation unrolls blocks of this many
const NPY_BUFSIZE = 8192; // NumPy's ufunc buffer: a float32 -> float64 sum is pairwise per buffer

/** The generation options, named and defaulted as transformers' GenerationConfig; checked once. */
export class SamplingParams {
  constructor(o = {}) {
    this.max_new_tokens = o.max_new_tokens ?? 32;
    this.do_sample = o.do_sample ?? false;
    this.temperature = o.temperature ?? 1.0;
    this.top_k = o.top_k ?? 50;
    this.top_p = o.top_p ?? 1.0;
    this.min_p = o.min_p ?? null;
    this.repetition_penalty = o.repetition_penalty ?? 1.0;
    this.eos_token_id = [...(o.eos_token_id ?? [])];
    this.stop = [...(o.stop ?? [])];
    this.seed = o.seed ?? null;
    this.check();
    Object.freeze(this);
  }

  check() {
    const int = (v) => Number.isInteger(v);
    const real = (v) => typeof v === "number" && Number.isFinite(v);
    const fail = (msg) => {
      throw new SamplingError(msg);
    };
    if (!int(this.max_new_tokens) || this.max_new_tokens < 1) fail(`max_new_tokens must be an integer >= 1, got ${this.max_new_tokens}.`);
    if (!real(this.temperature) || this.temperature < 0) fail(`temperature must be >= 0 (0 means greedy), got ${this.temperature}.`);
    if (!int(this.top_k) || this.top_k < 0) fail(`top_k must be an integer >= 0 (0 disables it), got ${this.top_k}.`);
    if (!real(this.top_p) || !(this.top_p > 0 && this.top_p <= 1)) fail(`top_p must be in (0, 1] (1 disables it), got ${this.top_p}.`);
    if (this.min_p !== null && (!real(this.min_p) || !(this.min_p > 0 && this.min_p <= 1))) fail(`min_p must be in (0, 1], got ${this.min_p}.`);
    if (!real(this.repetition_penalty) || this.repetition_penalty <= 0) fail(`repetition_penalty must be > 0 (1 disables it), got ${this.repetition_penalty}.`);
    if (this.seed !== null && !((int(this.seed) && this.seed >= 0) || (typeof this.seed === "bigint" && this.seed >= 0n))) fail(`seed must be an integer >= 0, got ${this.seed}.`);
    if (this.stop.some((s) => typeof s !== "string" || !s)) fail("Stop strings must be non-empty strings.");
  }

  /** Argmax after the processors; the warpers only run when sampling (temperature 0 means greedy). */
  get greedy() {
    return !this.do_sample || this.temperature === 0;
  }
}

export class SamplingError extends Error {
  constructor(message) {
    super(message);
    this.name = "SamplingError";
  }
}

// ---- float64 sums in NumPy's order ---------------------------------------------------------------------------

/** NumPy's pairwise summation of a[off .. off+n) (the values as doubles). */
export function pairwiseSum(a, off, n) {
  if (n < 8) {
    let res = 0;
    for (let i = 0; i < n; i++) res += a[off + i];
    return res;
  }
  if (n <= PW_BLOCKSIZE) {
    const r = [a[off], a[off + 1], a[off + 2], a[off + 3], a[off + 4], a[off + 5], a[off + 6], a[off + 7]];
    let i = 8;
    for (; i < n - (n % 8); i += 8) for (let j = 0; j < 8; j++) r[j] += a[off + i + j];
    let res = r[0] + r[1] + (r[2] + r[3]) + (r[4] + r[5] + (r[6] + r[7]));
    for (; i < n; i++) res += a[off + i];
    return res;
  }
  let n2 = Math.floor(n / 2);
  n2 -= n2 % 8;
  return pairwiseSum(a, off, n2) + pairwiseSum(a, off + n2, n - n2);
}

/** x.sum(dtype=float64) of a float32 array: NumPy casts through its 8192-element buffer, pairwise per buffer. */
export function sumF64(x) {
  let acc = 0;
  for (let off = 0; off < x.length; off += NPY_BUFSIZE) acc += pairwiseSum(x, off, Math.min(NPY_BUFSIZE, x.length - off));
  return acc;
}

function maxOf(x) {
  let m = -Infinity;
  for (let i = 0; i < x.length; i++) if (x[i] > m) m = x[i];
  return m;
}

/** float32 softmax as torch computes it: exp of the shifted scores, times the float32 reciprocal of the sum. */
export function softmax(vals) {
  const m = maxOf(vals);
  const e = new Float32Array(vals.length);
  for (let i = 0; i < vals.length; i++) e[i] = Math.exp(f32(vals[i] - m));
  const r = f32(1 / f32(sumF64(e)));
  for (let i = 0; i < e.length; i++) e[i] = f32(e[i] * r);
  return e;
}

// ---- processors (the whole row) ------------------------------------------------------------------------------

/** RepetitionPenaltyLogitsProcessor: a seen token's score is divided by the penalty if positive, else multiplied. */
export function applyRepetitionPenalty(row, seen, penalty) {
  if (penalty === 1.0) return row;
  const out = Float32Array.from(row);
  const p = f32(penalty);
  for (const id of new Set(seen)) {
    if (id < out.length) out[id] = out[id] < 0 ? f32(out[id] * p) : f32(out[id] / p);
  }
  return out;
}

// ---- warpers (one row's surviving tokens) --------------------------------------------------------------------

function take(ids, vals, keep) {
  const v = new Float32Array(keep.length);
  const i2 = new Int32Array(keep.length);
  for (let j = 0; j < keep.length; j++) {
    v[j] = vals[keep[j]];
    i2[j] = ids === null ? keep[j] : ids[keep[j]];
  }
  return { ids: i2, vals: v };
}

/** TemperatureLogitsWarper, in float32; a temperature so small that every score overflows gives its limit. */
export function applyTemperature(row, temperature) {
  if (temperature === 1.0) return row;
  const t = f32(temperature);
  const out = new Float32Array(row.length);
  for (let i = 0; i < row.length; i++) out[i] = row[i] / t;
  const best = maxOf(row);
  if (maxOf(out) === -Infinity && best > -Infinity) for (let i = 0; i < row.length; i++) out[i] = row[i] === best ? 0 : -Infinity;
  return out;
}

/** The k-th largest value (k >= 1): a size-k min-heap, or a sorted copy when k is a large part of the row. */
function kthLargest(vals, k) {
  if (k * 8 > vals.length) return Float32Array.from(vals).sort()[vals.length - k];
  const heap = new Float32Array(k);
  let n = 0;
  const down = (i) => {
    for (;;) {
      const l = 2 * i + 1, r = l + 1;
      let s = i;
      if (l < n && heap[l] < heap[s]) s = l;
      if (r < n && heap[r] < heap[s]) s = r;
      if (s === i) return;
      [heap[i], heap[s]] = [heap[s], heap[i]];
      i = s;
    }
  };
  for (let i = 0; i < vals.length; i++) {
    const v = vals[i];
    if (n < k) {
      let c = n++;
      heap[c] = v;
      while (c > 0 && heap[(c - 1) >> 1] > heap[c]) {
        const p = (c - 1) >> 1;
        [heap[p], heap[c]] = [heap[c], heap[p]];
        c = p;
      }
    } else if (v > heap[0]) {
      heap[0] = v;
      down(0);
    }
  }
  return heap[0];
}

/** TopKLogitsWarper: the k best and every tie with the k-th, in row order; 0 disables it. */
export function applyTopK(ids, vals, k) {
  if (k <= 0 || k >= vals.length) return { ids, vals };
  const kth = kthLargest(vals, k);
  const keep = [];
  for (let i = 0; i < vals.length; i++) if (vals[i] >= kth) keep.push(i);
  return take(ids, vals, keep);
}

/** TopPLogitsWarper: sort ascending (ties: lower id first), float64 cumulative mass rounded to float32, remove
 * where <= float32(1 - top_p); the best token always stays. The survivors come out in ascending order. */
export function applyTopP(ids, vals, topP) {
  if (topP >= 1.0) return { ids, vals };
  const probs = softmax(vals);
  const threshold = f32(1.0 - topP);
  const order = Array.from(vals.keys()).sort((a, b) => vals[a] - vals[b] || a - b);
  let cum = 0;
  let removed = 0;
  for (const i of order) {
    cum += probs[i];
    if (f32(cum) <= threshold) removed++;
    else break;
  }
  return take(ids, vals, order.slice(Math.min(removed, order.length - 1)));
}

/** MinPLogitsWarper: remove tokens whose probability is below min_p x the best one's; null disables it. */
export function applyMinP(ids, vals, minP) {
  if (minP === null) return { ids, vals };
  const probs = softmax(vals);
  let best = 0;
  for (let i = 1; i < probs.length; i++) if (probs[i] > probs[best]) best = i;
  const threshold = f32(f32(minP) * probs[best]);
  const keep = [];
  for (let i = 0; i < probs.length; i++) if (!(probs[i] < threshold) || i === best) keep.push(i);
  return take(ids, vals, keep);
}

/** One processed row -> {ids (null: the whole row), probs}: the warpers in transformers' order, then softmax. */
export function warpRow(row, params) {
  let s = { ids: null, vals: applyTemperature(row, params.temperature) };
  s = applyTopK(s.ids, s.vals, params.top_k);
  if (maxOf(s.vals) === -Infinity) throw new SamplingError("No token is left to sample; relax the bans.");
  s = applyTopP(s.ids, s.vals, params.top_p);
  s = applyMinP(s.ids, s.vals, params.min_p);
  return { ids: s.ids, probs: softmax(s.vals) };
}

// ---- the draw -------------------------------------------------------------------------------------------------

/** The first index whose cumulative value exceeds target; past the end (rounding), the first reaching the last. */
function firstAbove(cdf, target) {
  let lo = 0, hi = cdf.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (cdf[mid] <= target) lo = mid + 1;
    else hi = mid;
  }
  if (lo < cdf.length) return lo;
  const last = cdf[cdf.length - 1];
  let i = 0;
  while (cdf[i] < last) i++;
  return i;
}

function cumsum(x, off = 0, n = x.length) {
  const out = new Float64Array(n);
  let acc = 0;
  for (let i = 0; i < n; i++) out[i] = acc += x[off + i];
  return out;
}

/** One draw by inverse CDF from one uniform (rng.random()), as gpt2edge's sample_index walks it. */
export function sampleIndex(probs, rng) {
  const u = rng.random();
  if (probs.length <= SMALL_DRAW) {
    const cdf = cumsum(probs);
    return firstAbove(cdf, u * cdf[cdf.length - 1]);
  }
  const nBlocks = Math.ceil(probs.length / BLOCK);
  const padded = new Float64Array(nBlocks * BLOCK);
  padded.set(probs);
  const sums = new Float64Array(nBlocks);
  for (let b = 0; b < nBlocks; b++) sums[b] = pairwiseSum(padded, b * BLOCK, BLOCK);
  const blockCdf = cumsum(sums);
  const total = blockCdf[nBlocks - 1];
  const b = firstAbove(blockCdf, u * total);
  const target = u * total - (b ? blockCdf[b - 1] : 0);
  return b * BLOCK + firstAbove(cumsum(padded, b * BLOCK, BLOCK), target);
}

/** The first index of the row's largest score. */
export function argmax(row) {
  let best = 0;
  for (let i = 1; i < row.length; i++) if (row[i] > row[best]) best = i;
  return best;
}

/** A constraint's mask (Uint8Array, 1 = allowed): every other token's score becomes -inf. */
export function applyMask(row, allowed) {
  const out = Float32Array.from(row);
  let any = false;
  for (let i = 0; i < out.length; i++) {
    if (!allowed[i]) out[i] = -Infinity;
    else if (out[i] > -Infinity) any = true;
  }
  if (!any) throw new SamplingError("The constraint allows no token here.");
  return out;
}

/** One (V,) row of log-probs -> the next token id: the processors, the constraint's mask (`allowed`, or null),
 * then argmax or the warpers and one draw (gpt2edge.runtime.decoding.sampling.next_tokens' order). */
export function nextToken(row, params, seen, rng, allowed = null) {
  let scores = applyRepetitionPenalty(row, seen, params.repetition_penalty);
  if (allowed) scores = applyMask(scores, allowed);
  if (params.greedy) return argmax(scores);
  const { ids, probs } = warpRow(scores, params);
  const i = sampleIndex(probs, rng);
  return ids === null ? i : ids[i];
}

export { defaultRng };

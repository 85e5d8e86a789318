// NumPy's default generator in JavaScript: np.random.default_rng(seed).random(), bit for bit.
//
// default_rng(seed) = Generator(PCG64(SeedSequence(seed))). SeedSequence hashes the seed's 32-bit words into
// a 128-bit pool and expands it into PCG64's 128-bit state and increment; PCG64 is a 128-bit LCG with the
// XSL-RR output; random() takes the top 53 bits of one 64-bit output. 128-bit arithmetic uses BigInt.

const INIT_A = 0x43b0d7e5;
const MULT_A = 0x931e8875;
const INIT_B = 0x8b51f9dd;
const MULT_B = 0x58f38ded;
const MIX_MULT_L = 0xca01f9dd;
const MIX_MULT_R = 0x4973f715;
const POOL_SIZE = 4;

const M64 = (1n << 64n) - 1n;
const M128 = (1n << 128n) - 1n;
const PCG_MULT = (2549297995355413924n << 64n) + 4865540595714422341n;

/** A non-negative integer seed (number or BigInt) as little-endian 32-bit words; 0 gives [0]. */
function seedWords(seed) {
  let n = BigInt(seed);
  if (n < 0n) throw new RangeError(`seed must be an integer >= 0, got ${seed}`);
  const words = [];
  do {
    words.push(Number(n & 0xffffffffn));
    n >>= 32n;
  } while (n > 0n);
  return words;
}

// SeedSequence's hash: every operation is on uint32 with wrap-around (Math.imul, then >>> 0)
function hashmix(value, hashConst) {
  value = (value ^ hashConst.v) >>> 0;
  hashConst.v = Math.imul(hashConst.v, MULT_A) >>> 0;
  value = Math.imul(value, hashConst.v) >>> 0;
  return (value ^ (value >>> 16)) >>> 0;
}

function mix(x, y) {
  const r = (Math.imul(MIX_MULT_L, x) - Math.imul(MIX_MULT_R, y)) >>> 0;
  return (r ^ (r >>> 16)) >>> 0;
}

/** SeedSequence(seed).pool: 4 uint32 words. */
export function seedPool(seed) {
  const entropy = seedWords(seed);
  const pool = new Array(POOL_SIZE).fill(0);
  const h = { v: INIT_A };
  for (let i = 0; i < POOL_SIZE; i++) pool[i] = hashmix(i < entropy.length ? entropy[i] : 0, h);
  for (let src = 0; src < POOL_SIZE; src++) {
    for (let dst = 0; dst < POOL_SIZE; dst++) {
      if (src !== dst) pool[dst] = mix(pool[dst], hashmix(pool[src], h));
    }
  }
  for (let src = POOL_SIZE; src < entropy.length; src++) {
    for (let dst = 0; dst < POOL_SIZE; dst++) pool[dst] = mix(pool[dst], hashmix(entropy[src], h));
  }
  return pool;
}

/** SeedSequence.generate_state(n, np.uint64) as BigInts (pairs of uint32 words, low word first). */
export function generateState64(pool, n) {
  const words = [];
  let h = INIT_B;
  for (let i = 0; i < 2 * n; i++) {
    let v = (pool[i % pool.length] ^ h) >>> 0;
    h = Math.imul(h, MULT_B) >>> 0;
    v = Math.imul(v, h) >>> 0;
    words.push((v ^ (v >>> 16)) >>> 0);
  }
  const out = [];
  for (let i = 0; i < n; i++) out.push((BigInt(words[2 * i + 1]) << 32n) | BigInt(words[2 * i]));
  return out;
}

/** PCG64 (XSL-RR 128/64), seeded as NumPy seeds it from a SeedSequence. */
export class PCG64 {
  constructor(seed) {
    const [s0, s1, i0, i1] = generateState64(seedPool(seed), 4);
    const initState = (s0 << 64n) | s1;
    const initSeq = (i0 << 64n) | i1;
    // pcg_setseq_128_srandom_r
    this.inc = ((initSeq << 1n) | 1n) & M128;
    this.state = 0n;
    this.step();
    this.state = (this.state + initState) & M128;
    this.step();
  }

  step() {
    this.state = (this.state * PCG_MULT + this.inc) & M128;
  }

  /** The next 64-bit output, a BigInt. */
  next64() {
    this.step();
    const s = this.state;
    const x = ((s >> 64n) ^ s) & M64;
    const rot = s >> 122n;
    return ((x >> rot) | (x << ((64n - rot) & 63n))) & M64;
  }

  /** Generator.random(): a double in [0, 1) from the top 53 bits. */
  random() {
    return Number(this.next64() >> 11n) / 9007199254740992;
  }
}

/** The generator a seed gives: NumPy's stream for a seed, or a random seed when none is given. */
export function defaultRng(seed) {
  if (seed === undefined || seed === null) {
    const words = new Uint32Array(4);
    globalThis.crypto.getRandomValues(words);
    seed = words.reduce((acc, w) => (acc << 32n) | BigInt(w), 0n);
  }
  return new PCG64(seed);
}

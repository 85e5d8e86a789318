// The graph as a language model on onnxruntime-web: one session, one KV cache, prefill and decode steps.
//
// Two cache contracts, from the manifest's graph.kv_cache:
//   concat  past (1, nh, P, hs) in, present (1, nh, P+S, hs) out: the present becomes the next past.
//   shared  past = present = (1, nh, capacity, hs), allocated once for the whole generation: the graph's
//           GroupQueryAttention writes the new positions in place and reads the valid ones.
// On WebGPU the presents stay on the GPU (preferredOutputLocation "gpu-buffer") and are fed back as the next
// past: the cache never crosses to the CPU, only the (1, V) log-probs do. On WASM, onnxruntime-web copies
// every input into its heap and every output out of it, so the cache crosses the JS boundary each step.

export class ModelError extends Error {
  constructor(message) {
    super(message);
    this.name = "ModelError";
  }
}

function dirname(path) {
  const i = path.lastIndexOf("/");
  return i < 0 ? "" : path.slice(0, i + 1);
}

export class WebLM {
  constructor(ort, session, folder, device) {
    this.ort = ort;
    this.session = session;
    this.device = device;
    const d = folder.dims;
    const g = folder.graph;
    this.nLayer = d.n_layer;
    this.nHead = d.n_head;
    this.headDim = d.head_dim;
    this.vocabSize = d.vocab_size;
    this.nPositions = d.n_positions;
    this.shared = g.kv_cache === "shared";
    this.headAll = g.head === "all";
    this.pastNames = [];
    this.presentNames = [];
    for (let i = 0; i < this.nLayer; i++) {
      for (const kv of ["key", "value"]) {
        this.pastNames.push(`past_key_values.${i}.${kv}`);
        this.presentNames.push(`present.${i}.${kv}`);
      }
    }
    this.past = null;
    this.pastLen = 0;
    this.capacity = 0;
  }

  /** Create the session from the folder's checked graph bytes (and external data files). */
  static async load(ort, folder, { device = "wasm", onBytes = () => {} } = {}) {
    const g = folder.graph;
    const model = await folder.bytes(g.file, "the graph");
    onBytes(model.byteLength);
    const externalData = [];
    for (const f of g.files) {
      if (f === g.file) continue;
      const data = await folder.bytes(f, "the graph's weights");
      onBytes(data.byteLength);
      externalData.push({ path: f.slice(dirname(g.file).length), data });
    }
    const options = { executionProviders: [device], graphOptimizationLevel: "all", externalData };
    if (device === "webgpu") {
      const names = [];
      for (let i = 0; i < folder.dims.n_layer; i++) names.push(`present.${i}.key`, `present.${i}.value`);
      options.preferredOutputLocation = Object.fromEntries(names.map((n) => [n, "gpu-buffer"]));
    }
    let session;
    try {
      session = await ort.InferenceSession.create(model, options);
    } catch (e) {
      const first = String(e?.message ?? e).split("\n")[0];
      throw new ModelError(`onnxruntime-web (${device}) cannot load this graph: ${first}`);
    }
    return new WebLM(ort, session, folder, device);
  }

  /** A new generation of at most `capacity` positions: an empty (concat) or zeroed (shared) cache. */
  start(capacity) {
    this.release();
    this.capacity = capacity;
    this.pastLen = 0;
    const len = this.shared ? capacity : 0;
    const size = this.nHead * len * this.headDim;
    const dims = [1, this.nHead, len, this.headDim];
    // (1, nh, len, hs) per key / value tensor: the shared buffers are allocated here, once per generation
    this.past = this.pastNames.map(() => new this.ort.Tensor("float32", new Float32Array(size), dims));
  }

  /** Run `ids` (the prompt, or one token) on top of the cache; returns next-token log-probs (V,). */
  async forward(ids) {
    const S = ids.length;
    const P = this.pastLen;
    if (P + S > this.capacity) throw new ModelError(`the cache holds ${this.capacity} positions, this step needs ${P + S}`);
    const T = this.ort.Tensor;
    const positions = BigInt64Array.from(ids, (_, i) => BigInt(P + i));
    const feeds = {
      input_ids: new T("int64", BigInt64Array.from(ids, BigInt), [1, S]),
      attention_mask: new T("int64", new BigInt64Array(P + S).fill(1n), [1, P + S]),
      position_ids: new T("int64", positions, [1, S]),
    };
    this.pastNames.forEach((n, i) => (feeds[n] = this.past[i]));
    let out;
    try {
      out = await this.session.run(feeds);
    } catch (e) {
      throw new ModelError(`onnxruntime-web failed to run the graph: ${String(e?.message ?? e).split("\n")[0]}`);
    }
    const old = this.past;
    this.past = this.presentNames.map((n) => out[n]);
    if (this.device === "webgpu") old.forEach((t) => t.location === "gpu-buffer" && t.dispose());
    this.pastLen = P + S;
    const lp = out.logprobs ?? out[this.session.outputNames[0]];
    const data = lp.location === "cpu" ? lp.data : await lp.getData();
    // head "all" gives every position (1, S, V): the last one predicts the next token
    return this.headAll ? data.subarray((S - 1) * this.vocabSize, S * this.vocabSize) : data.subarray(0, this.vocabSize);
  }

  release() {
    if (this.past && this.device === "webgpu") this.past.forEach((t) => t.location === "gpu-buffer" && t.dispose());
    this.past = null;
  }
}

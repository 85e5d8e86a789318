// WebGenerator: text in, streamed text out, on a `gpt2edge convert --format web` folder (the browser twin of
// gpt2edge.runtime.Generator: the same defaults, the same length rule, the same sampler and seeded draws).

import { Tokenizer } from "@huggingface/tokenizers";

import { Constraint, ConstraintEngine, ConstraintError, vocabularyOf } from "./constraints.js";
import { FolderError, WebFolder } from "./folder.js";
import { WebLM } from "./model.js";
import { defaultRng } from "./rng.js";
import { nextToken, SamplingError, SamplingParams } from "./sampler.js";
import { TextStream } from "./text-stream.js";

const CONFIG_KEYS = ["max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty"];
const SAMPLING_KNOBS = ["temperature", "top_k", "top_p", "min_p"]; // giving one turns sampling on

export class GenerationError extends Error {
  constructor(message) {
    super(message);
    this.name = "GenerationError";
  }
}

function idList(v) {
  return v === undefined || v === null ? [] : Array.isArray(v) ? v.map(Number) : [Number(v)];
}

/** null when the prompt and max_new_tokens fit the model's positions, else the message saying what to change. */
export function lengthError(promptLen, maxNew, nPositions) {
  if (promptLen + maxNew <= nPositions) return null;
  if (maxNew >= nPositions) {
    return `max_new_tokens=${maxNew} leaves no room for the ${promptLen}-token prompt in the model's ${nPositions} positions; lower max_new_tokens below ${nPositions}.`;
  }
  const room = nPositions - promptLen;
  const fix = room > 0 ? `lower max_new_tokens to at most ${room}, or shorten the prompt` : "shorten the prompt";
  return `The prompt has ${promptLen} tokens; with max_new_tokens=${maxNew} only ${nPositions - maxNew} fit the model's ${nPositions} positions: ${fix}.`;
}

export class WebGenerator {
  /** tokenizerJson: the parsed tokenizer.json (the constraint engine's vocabulary), or null: no constraints. */
  constructor(folder, tokenizer, lm, defaults, tokenizerJson = null) {
    this.folder = folder;
    this.tokenizer = tokenizer;
    this.lm = lm;
    this.defaults = defaults;
    this.eos = idList(defaults.eos_token_id);
    this.bos = defaults.bos_token_id ?? this.eos[0] ?? 0;
    this.tokenizerJson = tokenizerJson;
    this.engine = null; // the constraint engine (xgrammar), made at the first constrained call
  }

  /** The constraint compiled for this folder's tokenizer and vocabulary (cached by the engine), or null. */
  async compileConstraint(value) {
    const c = Constraint.from(value);
    if (!c) return null;
    if (!this.engine) {
      if (!this.tokenizerJson) throw new ConstraintError("This generator was made without its tokenizer.json, which the constraint engine needs.");
      this.engine = ConstraintEngine.create(vocabularyOf(this.tokenizerJson), this.lm.vocabSize, this.eos).catch((e) => {
        this.engine = null; // the next constrained call tries again
        throw e;
      });
    }
    return (await this.engine).compile(c);
  }

  /** Open the folder at `base` (its URL), check and load the tokenizer and the graph on `device`. */
  static async load(ort, base, { device = "wasm", onBytes } = {}) {
    const folder = await WebFolder.open(base);
    const tokName = folder.manifest.tokenizer ?? "tokenizer.json";
    if (!(tokName in folder.manifest.files)) {
      throw new FolderError(`The folder has no tokenizer (${tokName} is not in manifest.json); convert the export again.`);
    }
    const tokJson = await folder.json(tokName, "the tokenizer");
    const tokConfig = "tokenizer_config.json" in folder.manifest.files ? await folder.json("tokenizer_config.json", "the tokenizer config") : {};
    let tokenizer;
    try {
      tokenizer = new Tokenizer(tokJson, tokConfig);
    } catch (e) {
      throw new FolderError(`The tokenizer (${tokName}) cannot be read (${e.message}); convert the export again.`);
    }
    const defaults = await folder.generationDefaults();
    const lm = await WebLM.load(ort, folder, { device, onBytes });
    return new WebGenerator(folder, tokenizer, lm, defaults, tokJson);
  }

  /** transformers' defaults, then generation_config.json, then the call's values (giving a sampling knob turns
   * sampling on unless do_sample is given). */
  params(options = {}) {
    const values = {};
    for (const k of CONFIG_KEYS) if (this.defaults[k] !== undefined && this.defaults[k] !== null) values[k] = this.defaults[k];
    const given = Object.fromEntries(Object.entries(options).filter(([, v]) => v !== undefined && v !== null));
    if (!("do_sample" in given) && SAMPLING_KNOBS.some((k) => k in given)) given.do_sample = true;
    const ignoreEos = Boolean(given.ignore_eos);
    delete given.ignore_eos;
    Object.assign(values, given);
    values.eos_token_id = ignoreEos ? [] : this.eos;
    return new SamplingParams(values);
  }

  encode(prompt) {
    const ids = this.tokenizer.encode(prompt, { add_special_tokens: false }).ids;
    return ids.length ? ids : [this.bos]; // GPT-2 starts an empty prompt from <|endoftext|>
  }

  decode(ids) {
    return this.tokenizer.decode(ids, { skip_special_tokens: true, clean_up_tokenization_spaces: false });
  }

  /**
   * Generate for one prompt; yields {piece, token} after every token (piece: new printable text, maybe "").
   * Returns (as the generator's return value) the result: token_ids, text, pieces, finish_reason ("eos", "stop",
   * "length" or "stopped"), prefill_ms, decode_ms_per_token, tokens_per_s. `signal`: an AbortSignal (Stop).
   * options.constraint: structured output (constraints.js: a Constraint, or {json_schema}, {regex}, {choice},
   * {grammar}, {json_object: true}); the text is then a sentence of its language, or finish "length".
   */
  async *stream(prompt, options = {}, signal = undefined) {
    let params;
    const { constraint, ...rest } = options;
    try {
      params = this.params(rest);
    } catch (e) {
      throw e instanceof SamplingError ? new GenerationError(e.message) : e;
    }
    let compiled;
    try {
      compiled = await this.compileConstraint(constraint);
    } catch (e) {
      throw e instanceof ConstraintError ? new GenerationError(e.message) : e;
    }
    const ids = this.encode(prompt);
    const error = lengthError(ids.length, params.max_new_tokens, this.lm.nPositions);
    if (error) throw new GenerationError(error);
    const rng = defaultRng(params.seed);
    const text = new TextStream(this.tokenizer, params.stop);
    const eos = new Set(params.eos_token_id);
    const seen = [...ids];
    const generated = [];
    const decodeMs = [];
    const pieces = []; // the streamed text, piece by piece (joined: the final text)
    const matcher = compiled ? await compiled.matcher() : null; // this call's grammar state
    let finish = null;
    // the last sampled token is never fed back: the cache needs prompt + max_new_tokens - 1 positions
    this.lm.start(ids.length + params.max_new_tokens - 1);
    const t0 = performance.now();
    let prefillMs = 0;
    try {
      let logprobs = await this.lm.forward(ids);
      prefillMs = performance.now() - t0;
      for (let step = 0; step < params.max_new_tokens; step++) {
        if (Number.isNaN(logprobs[0])) throw new GenerationError(`The model produced NaN log-probabilities at step ${step}; try the fp32 folder.`);
        let tok;
        try {
          tok = nextToken(logprobs, params, seen, rng, matcher ? matcher.allowed(params.eos_token_id) : null);
        } catch (e) {
          throw e instanceof SamplingError ? new GenerationError(e.message) : e;
        }
        generated.push(tok);
        seen.push(tok);
        if (eos.has(tok)) finish = "eos";
        else {
          const stopString = text.push(tok);
          if (matcher) await matcher.advance(tok);
          if (stopString || matcher?.done) finish = "stop"; // a stop string, or the grammar is complete
          else if (generated.length >= params.max_new_tokens) finish = "length";
          else if (signal?.aborted) finish = "stopped";
        }
        if (finish) text.finish();
        const piece = text.take();
        if (piece) pieces.push(piece);
        yield { piece, token: tok };
        if (finish) break;
        const t1 = performance.now();
        logprobs = await this.lm.forward([tok]);
        decodeMs.push(performance.now() - t1);
      }
    } finally {
      matcher?.dispose();
    }
    const wallMs = performance.now() - t0;
    this.lm.release();
    const mean = decodeMs.length ? decodeMs.reduce((a, b) => a + b, 0) / decodeMs.length : 0;
    return {
      token_ids: generated,
      prompt_token_ids: ids,
      text: text.text,
      pieces,
      finish_reason: finish,
      prefill_ms: prefillMs,
      decode_ms_per_token: mean,
      tokens_per_s: generated.length / (wallMs / 1e3),
    };
  }
}

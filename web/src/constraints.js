// Structured output in the browser (gpt2edge.runtime.constraints' twin): the same constraint kinds, checked
// against the same input limits, compiled by xgrammar's WASM build (@mlc-ai/web-xgrammar, pinned in
// package.json; copied into a web folder as vendor/xgrammar/xgrammar.js).
//
// What each kind compiles to, configured as the Python engine (llguidance) is, so that both give the same
// allowed tokens (tests/web/test_web_constraints.py compares their masks token by token):
//   json_schema, json_object: xgrammar's JSON Schema converter (JSON_OPTIONS: compact, no whitespace between
//     tokens, "," and ":" as the separators, as llguidance's whitespace_flexible=false; not strict: what the
//     schema does not forbid is allowed, as JSON Schema says and llguidance does), its EBNF patched where it
//     reads JSON otherwise than llguidance (JSON_RULES), bounded integers as enums (boundedIntegersAsEnums)
//   regex: a structural tag {type: "regex"} (the whole output matches; xgrammar's regex syntax, not Rust's)
//   choice: an EBNF alternation of the strings
//   gbnf: xgrammar's EBNF, which reads llama.cpp's GBNF (`root` is the start rule)
//   lark: refused in one line (xgrammar has no Lark reader): give the grammar as GBNF
// The mask sits where Python puts it (after the repetition penalty, before the warpers: generator.js), end
// tokens are allowed only where the grammar accepts, and a row ends ("stop") when its grammar is complete.

export const KINDS = ["json_schema", "json_object", "regex", "choice", "lark", "gbnf"];
export const MAX_TEXT_BYTES = 256 * 1024; // gpt2edge.runtime.constraints.spec's limits
export const MAX_DEPTH = 100;
export const MAX_CHOICES = 4096;
export const CACHE_SIZE = 16; // compiled constraints kept per engine (least recently used out)
// the options of xgrammar's JSON Schema converter that match llguidance's {"whitespace_flexible": false}
export const JSON_OPTIONS = { anyWhitespace: false, indent: -1, separators: [",", ":"], strictMode: false };

export class ConstraintError extends Error {
  constructor(message) {
    super(message);
    this.name = "ConstraintError";
  }
}

/** The deepest bracket nesting, ignoring brackets inside JSON strings (jsonText) or escaped by a backslash. */
function depthOf(text, jsonText) {
  let depth = 0, best = 0, inString = false, escaped = false;
  for (const ch of text) {
    if (escaped) escaped = false;
    else if (ch === "\\") escaped = true;
    else if (jsonText && ch === '"') inString = !inString;
    else if (inString) continue;
    else if (ch === "[" || ch === "{" || ch === "(") best = Math.max(best, ++depth);
    else if (ch === "]" || ch === "}" || ch === ")") depth = Math.max(0, depth - 1);
  }
  return best;
}

function checkText(kind, text) {
  if (typeof text !== "string") throw new ConstraintError(`A ${kind} constraint takes a string, got ${typeof text}.`);
  if (!text.trim()) throw new ConstraintError(`The ${kind} constraint is empty.`);
  const size = new TextEncoder().encode(text).length;
  if (size > MAX_TEXT_BYTES) throw new ConstraintError(`The ${kind} constraint is ${size} bytes; the limit is ${MAX_TEXT_BYTES}.`);
  const depth = depthOf(text, kind === "json_schema" || kind === "choice");
  if (depth > MAX_DEPTH) throw new ConstraintError(`The ${kind} constraint nests ${depth} levels deep; the limit is ${MAX_DEPTH}.`);
}

/** What the generated text must be: kind (one of KINDS) and text (the schema as JSON text, the regex, the
 * grammar, or the choices as a JSON list), checked at construction as Python's Constraint is. */
export class Constraint {
  constructor(kind, text) {
    if (!KINDS.includes(kind)) throw new ConstraintError(`Unknown constraint kind ${JSON.stringify(kind)}; one of ${KINDS.join(", ")}.`);
    checkText(kind, text);
    if (kind === "json_schema") {
      let schema;
      try {
        schema = JSON.parse(text);
      } catch (e) {
        throw new ConstraintError(`The JSON Schema is not valid JSON: ${e.message.split("\n")[0]}.`);
      }
      if (typeof schema !== "boolean" && (schema === null || typeof schema !== "object" || Array.isArray(schema))) {
        throw new ConstraintError(`A JSON Schema is an object (or true/false), got ${Array.isArray(schema) ? "a list" : typeof schema}.`);
      }
    }
    this.kind = kind;
    this.text = text;
    Object.freeze(this);
  }

  static jsonSchema(schema) {
    return new Constraint("json_schema", typeof schema === "string" ? schema : JSON.stringify(schema));
  }

  static jsonObject() {
    return new Constraint("json_object", '{"type": "object"}');
  }

  static regex(pattern) {
    return new Constraint("regex", pattern);
  }

  static choice(options) {
    if (!Array.isArray(options)) throw new ConstraintError("A choice constraint takes a list of strings.");
    if (!options.length || !options.every((o) => typeof o === "string" && o)) throw new ConstraintError("A choice constraint takes a non-empty list of non-empty strings.");
    if (options.length > MAX_CHOICES) throw new ConstraintError(`A choice constraint has ${options.length} options; the limit is ${MAX_CHOICES}.`);
    return new Constraint("choice", JSON.stringify(options));
  }

  static lark(grammar) {
    return new Constraint("lark", grammar);
  }

  static gbnf(grammar) {
    return new Constraint("gbnf", grammar);
  }

  /** A grammar file's text: GBNF or Lark by the name's extension, else by content (GBNF rules use `::=`). */
  static grammar(text, name = "") {
    const lower = name.toLowerCase();
    if (lower.endsWith(".gbnf")) return Constraint.gbnf(text);
    if (lower.endsWith(".lark")) return Constraint.lark(text);
    return typeof text === "string" && text.includes("::=") ? Constraint.gbnf(text) : Constraint.lark(text);
  }

  /** A call's `constraint` option: a Constraint, {kind, text}, or one of the server's spellings ({json_schema},
   * {regex}, {choice}, {grammar}, {json_object: true}); null/undefined for none. */
  static from(value) {
    if (value === undefined || value === null || value instanceof Constraint) return value ?? null;
    if (typeof value !== "object" || Array.isArray(value)) throw new ConstraintError(`constraint must be a Constraint or an object such as {regex: "[0-9]+"}, got ${Array.isArray(value) ? "a list" : typeof value}.`);
    if ("kind" in value) return new Constraint(value.kind, value.text);
    const given = ["json_schema", "json_object", "regex", "choice", "grammar", "gbnf", "lark"].filter((k) => value[k] !== undefined && value[k] !== null && value[k] !== false && value[k] !== "");
    if (given.length !== 1) throw new ConstraintError(`Give one constraint (json_schema, json_object, regex, choice or grammar), got ${given.length ? given.join(" and ") : "none"}.`);
    const [k] = given;
    if (k === "json_schema") return Constraint.jsonSchema(value[k]);
    if (k === "json_object") return Constraint.jsonObject();
    if (k === "choice") return Constraint.choice(value[k]);
    if (k === "grammar") return Constraint.grammar(value[k]);
    return new Constraint(k, value[k]);
  }

  describe() {
    const short = this.text.length <= 40 ? this.text : this.text.slice(0, 37) + "...";
    return `${this.kind} ${JSON.stringify(short)}`;
  }
}

/** A string as an xgrammar EBNF literal: printable ASCII as it is, everything else as \uXXXX / \UXXXXXXXX. */
export function ebnfLiteral(s) {
  let out = '"';
  for (const ch of s) {
    const c = ch.codePointAt(0);
    if (ch === '"' || ch === "\\") out += "\\" + ch;
    else if (c >= 0x20 && c < 0x7f) out += ch;
    else if (c <= 0xffff) out += "\\u" + c.toString(16).padStart(4, "0");
    else out += "\\U" + c.toString(16).padStart(8, "0");
  }
  return out + '"';
}

// xgrammar 0.1.27's JSON grammar, rule by rule as llguidance reads JSON (compact): the built-in rules for
// values the schema leaves open (any JSON in a free object or array) use its default ", " separator whatever
// the separators asked for; its strings take DEL (U+007F) and, with a length bound, control characters, which
// llguidance's refuse; its escapes take "\/" and any "\uXXXX", where llguidance 1.9 takes "\u" only for what
// cannot be written as it is (U+0000-U+001F, U+007F); its integers refuse "-0", which llguidance's take.
const JSON_RULES = [
  ['basic_array ::= (("[" "" basic_any (", " basic_any)* "" "]")', 'basic_array ::= (("[" "" basic_any ("," basic_any)* "" "]")'],
  ['(", " basic_string ":" basic_any)*', '("," basic_string ":" basic_any)*'],
  ['[^\\0-\\x1f\\"\\\\\\r\\n]', '[^\\0-\\x1f\\x7f\\"\\\\]'],
  [
    'basic_escape ::= ["\\\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]',
    'basic_escape ::= ["\\\\bfnrt] | "u" "00" ([01] [A-Fa-f0-9] | "7" [Ff])',
  ],
  ['basic_integer ::= ("0" | "-"? [1-9] [0-9]*)', 'basic_integer ::= ("-"? ("0" | [1-9] [0-9]*))'],
  ['"\\"" [^"\\\\\\r\\n]{', '"\\"" [^\\0-\\x1f\\x7f"\\\\]{'], // a string with minLength / maxLength
];

/** xgrammar's EBNF for a JSON Schema with JSON_RULES applied (another xgrammar that spells a rule otherwise
 * keeps its own: tests/web/test_web_constraints.py's mask comparison shows it). */
export function llguidanceJSON(ebnf) {
  for (const [from, to] of JSON_RULES) ebnf = ebnf.replaceAll(from, to);
  return ebnf;
}

export const MAX_ENUM_RANGE = 4096;

/** A JSON Schema with xgrammar 0.1.27's wrong numeric bounds kept out: its range rules take too much (0..150
 * takes 151..159; a number of at most 1 takes 1.5). An integer bounded on both sides with at most
 * MAX_ENUM_RANGE values becomes the enum of those values (the same language); an upper bound on a wider
 * integer, or any bound on a number, is refused in one line. Lower bounds alone compile right and stay. */
export function boundedIntegersAsEnums(schema) {
  const walk = (node) => {
    if (Array.isArray(node)) return node.map(walk);
    if (node === null || typeof node !== "object") return node;
    const out = {};
    for (const [k, v] of Object.entries(node)) out[k] = walk(v);
    const bounds = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"].filter((k) => typeof out[k] === "number");
    if (!bounds.length || (out.type !== "integer" && out.type !== "number")) return out;
    const upper = bounds.some((k) => k.endsWith("aximum"));
    if (out.type === "number" || upper) {
      let lo = Math.max(out.minimum ?? -Infinity, (out.exclusiveMinimum ?? -Infinity) + 1);
      let hi = Math.min(out.maximum ?? Infinity, (out.exclusiveMaximum ?? Infinity) - 1);
      lo = Math.ceil(lo);
      hi = Math.floor(hi);
      if (out.type === "integer" && Number.isFinite(lo) && Number.isFinite(hi) && hi - lo < MAX_ENUM_RANGE) {
        const rest = Object.fromEntries(Object.entries(out).filter(([k]) => k !== "type" && !bounds.includes(k)));
        const values = [];
        for (let x = lo; x <= hi; x++) values.push(x);
        if (!values.length) throw new ConstraintError(`The JSON Schema's integer range [${out.minimum ?? out.exclusiveMinimum}, ${out.maximum ?? out.exclusiveMaximum}] is empty.`);
        return { ...rest, enum: values };
      }
      throw new ConstraintError(`The browser's constraint engine (xgrammar 0.1.27) bounds numbers wrongly: ${bounds.join("/")} on a ${out.type === "number" ? "number" : `range of more than ${MAX_ENUM_RANGE} integers`} is not taken in the page; use an integer range of at most ${MAX_ENUM_RANGE} values, or the Python runtime.`);
    }
    return out;
  };
  return walk(schema);
}

/** GPT-2's byte-level alphabet: the character that stands for each byte in tokenizer.json. */
function byteLevelDecoder() {
  const bs = [];
  for (let b = 33; b <= 126; b++) bs.push(b);
  for (let b = 161; b <= 172; b++) bs.push(b);
  for (let b = 174; b <= 255; b++) bs.push(b);
  const cs = [...bs];
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!bs.includes(b)) {
      bs.push(b);
      cs.push(256 + n++);
    }
  }
  return new Map(cs.map((c, i) => [String.fromCodePoint(c), bs[i]]));
}

/** Uint8Array over the vocabulary: 1 for a token holding a byte that valid UTF-8 never has (0xC0, 0xC1,
 * 0xF5-0xFF). xgrammar's byte-level matcher lets a few of them through inside a character class; llguidance
 * (and any Unicode text) never does. */
export function invalidUtf8Tokens(vocabulary) {
  const decode = byteLevelDecoder();
  const out = new Uint8Array(vocabulary.length);
  vocabulary.forEach((t, i) => {
    for (const ch of t) {
      const b = decode.get(ch);
      if (b === 0xc0 || b === 0xc1 || b >= 0xf5) {
        out[i] = 1;
        break;
      }
    }
  });
  return out;
}

/** The page loads xgrammar's bundle (a UMD script that sets globalThis.xgrammar) from the folder's vendor/;
 * Node's tests set globalThis.xgrammar first (test/xgrammar-node.mjs). */
export async function loadXGrammar() {
  if (!globalThis.xgrammar) {
    try {
      await import(new URL("../vendor/xgrammar/xgrammar.js", import.meta.url).href);
    } catch (e) {
      throw new ConstraintError(`The constraint engine (vendor/xgrammar/xgrammar.js) could not be loaded: ${e.message}; convert the folder again.`);
    }
    if (!globalThis.xgrammar) throw new ConstraintError("vendor/xgrammar/xgrammar.js did not define the constraint engine; convert the folder again.");
  }
  return globalThis.xgrammar;
}

/** tokenizer.json -> every id's token string (xgrammar's "encoded vocab": byte-level strings, as in the file);
 * a special added token is "" (xgrammar treats it as special: never text), a hole too. */
export function vocabularyOf(tokenizerJson) {
  const vocab = [];
  for (const [t, i] of Object.entries(tokenizerJson.model?.vocab ?? {})) vocab[i] = t;
  for (const a of tokenizerJson.added_tokens ?? []) vocab[a.id] = a.special ? "" : a.content;
  for (let i = 0; i < vocab.length; i++) if (vocab[i] === undefined) vocab[i] = "";
  return vocab;
}

function firstLine(e) {
  const s = String(e?.message ?? e ?? "unknown error").split("\n").map((l) => l.trim()).filter(Boolean)[0] ?? "unknown error";
  return s.length <= 300 ? s : s.slice(0, 297) + "...";
}

/** xgrammar compiled for one tokenizer and model vocabulary; compile() keeps CACHE_SIZE constraints. */
export class ConstraintEngine {
  constructor(xg, info, compiler, vocabSize, vocabulary, eos) {
    Object.assign(this, { xg, info, compiler, vocabSize, tokenizerSize: vocabulary.length, eos: [...eos] });
    const invalid = invalidUtf8Tokens(vocabulary);
    this.invalidIds = Int32Array.from(invalid.keys()).filter((i) => invalid[i] && i < vocabSize);
    this.cache = new Map();
  }

  /** vocabulary: vocabularyOf(tokenizer.json); vocabSize: the model's logits (>= the tokenizer's); eos: the
   * tokens that end text (the folder's end-of-text ids). */
  static async create(vocabulary, vocabSize, eos, xg = undefined) {
    xg = xg ?? (await loadXGrammar());
    const size = Math.max(vocabSize, vocabulary.length);
    const info = await xg.TokenizerInfo.createTokenizerInfo(vocabulary, "byte_level", false, size, eos.length ? [...eos] : undefined);
    const compiler = await xg.GrammarCompiler.createGrammarCompiler(info, false);
    return new ConstraintEngine(xg, info, compiler, vocabSize, vocabulary, eos);
  }

  async compile(constraint) {
    const c = Constraint.from(constraint);
    const key = `${c.kind}\u0000${c.text}`;
    const hit = this.cache.get(key);
    if (hit) {
      this.cache.delete(key);
      this.cache.set(key, hit);
      return hit;
    }
    const t0 = performance.now();
    let grammar;
    try {
      grammar = await this.#compile(c);
    } catch (e) {
      if (e instanceof ConstraintError) throw e;
      const what = { json_schema: "JSON Schema", json_object: "JSON object", choice: "choice list" }[c.kind] ?? c.kind;
      // xgrammar's C++ errors abort its WASM call; the reason is on the console (stderr), the exception says only this
      const why = /^Aborted\(/.test(firstLine(e)) ? "xgrammar stopped on it (its reason is on the browser console)" : firstLine(e);
      throw new ConstraintError(`The ${what} constraint is refused by the engine: ${why.replace(/\.$/, "")}.`);
    }
    const compiled = new CompiledConstraint(this, c, grammar, performance.now() - t0);
    const probe = await compiled.matcher();
    try {
      const first = await probe.allowed(this.eos);
      if (!first.some((v) => v)) throw new ConstraintError(`The ${c.kind} constraint's language is empty: no text satisfies it.`);
    } finally {
      probe.dispose();
    }
    this.cache.set(key, compiled);
    while (this.cache.size > CACHE_SIZE) {
      const [oldest, old] = this.cache.entries().next().value;
      this.cache.delete(oldest);
      old.dispose();
    }
    return compiled;
  }

  async #compile(c) {
    const o = JSON_OPTIONS;
    switch (c.kind) {
      case "json_schema":
      case "json_object": {
        const schema = JSON.stringify(boundedIntegersAsEnums(JSON.parse(c.text)));
        const ebnf = await this.xg.Testings._jsonSchemaToEBNF(schema, o.anyWhitespace, o.indent, o.separators, o.strictMode);
        return this.compiler.compileGrammar(llguidanceJSON(ebnf));
      }
      case "regex": {
        // refused by xgrammar with an abort whose reason goes to the console only: named here, as llguidance does
        const unsupported = /\(\?<?[=!]/.test(c.text) ? "look-around" : /(^|[^\\])(\\\\)*\\([1-9]|k<)/.test(c.text) ? "a back-reference" : null;
        if (unsupported) throw new ConstraintError(`The regex constraint is refused by the engine: it uses ${unsupported}, which regular languages do not have.`);
        return this.compiler.compileStructuralTag({ type: "structural_tag", format: { type: "regex", pattern: c.text } });
      }
      case "choice":
        return this.compiler.compileGrammar(`root ::= ${JSON.parse(c.text).map(ebnfLiteral).join(" | ")}`);
      case "gbnf":
        return this.compiler.compileGrammar(c.text);
      case "lark":
        throw new ConstraintError("A Lark grammar needs the Python runtime (llguidance); the browser's engine (xgrammar) reads GBNF: give the grammar as GBNF (`root ::= ...`).");
    }
    throw new ConstraintError(`Unknown constraint kind ${c.kind}.`);
  }

  dispose() {
    for (const c of this.cache.values()) c.dispose();
    this.cache.clear();
    this.compiler.dispose();
    this.info.dispose();
  }
}

export class CompiledConstraint {
  constructor(engine, constraint, grammar, compileMs) {
    Object.assign(this, { engine, constraint, grammar, compileMs });
  }

  /** A fresh matcher: one row's grammar state. */
  async matcher() {
    const m = await this.engine.xg.GrammarMatcher.createGrammarMatcher(this.grammar, this.engine.eos.length ? [...this.engine.eos] : undefined);
    const row = new RowMatcher(this, m);
    await row.refresh();
    return row;
  }

  dispose() {
    this.grammar.dispose();
  }
}

/** One row's grammar state: the allowed tokens now, advance by a token, accepting or done. */
export class RowMatcher {
  constructor(compiled, matcher) {
    this.compiled = compiled;
    this.m = matcher;
    this.words = null; // the engine's bitmask of the current state
    this.nTokens = 0;
  }

  async refresh() {
    this.words = await this.m.getNextTokenBitmask();
  }

  #bit(i) {
    return (this.words[i >> 5] >>> (i & 31)) & 1;
  }

  /** The text so far is a whole sentence of the language: it may end here. */
  get acceptsEos() {
    return this.compiled.engine.eos.some((t) => this.#bit(t));
  }

  /** The language has no longer sentence (only an end token may follow): the row must end. */
  get done() {
    const { tokenizerSize } = this.compiled.engine;
    const eos = new Set(this.compiled.engine.eos);
    for (let w = 0; w < this.words.length; w++) {
      let bits = this.words[w];
      while (bits) {
        const i = (w << 5) + (31 - Math.clz32(bits & -bits));
        if (i < tokenizerSize && !eos.has(i)) return false;
        bits &= bits - 1;
      }
    }
    return true;
  }

  /** Uint8Array(vocabSize): 1 for the tokens that keep the text a prefix of the language; `eosIds` (the call's
   * end tokens) only where the text is complete; ids past the tokenizer's vocabulary never. */
  allowed(eosIds = []) {
    const { vocabSize, tokenizerSize, eos, invalidIds } = this.compiled.engine;
    const out = new Uint8Array(vocabSize);
    const n = Math.min(vocabSize, tokenizerSize);
    const words = this.words;
    for (let w = 0; w < words.length; w++) {
      let bits = words[w];
      if (bits === 0) continue;
      const base = w << 5;
      if (bits === -1) {
        out.fill(1, base, Math.min(base + 32, n));
        continue;
      }
      while (bits) {
        const low = bits & -bits;
        const i = base + 31 - Math.clz32(low);
        if (i < n) out[i] = 1;
        bits ^= low;
      }
    }
    for (const i of invalidIds) out[i] = 0;
    for (const t of eos) if (t < vocabSize) out[t] = 0; // the engine's end token is the call's to allow
    const accepts = this.acceptsEos ? 1 : 0;
    for (const t of eosIds) if (t < vocabSize) out[t] = accepts;
    return out;
  }

  /** The text the grammar forces next ("" when the next token is free): where llguidance, which tokenizes forced
   * text canonically, allows fewer tokens than xgrammar (docs/structured.md). */
  forcedText() {
    return this.m.findJumpForwardString();
  }

  /** Consume a generated token (not an end token) and compute the next state's mask. */
  async advance(token) {
    if (!this.m.acceptToken(token)) throw new ConstraintError(`Token ${token} breaks the constraint ${this.compiled.constraint.describe()}.`);
    this.nTokens++;
    await this.refresh();
  }

  dispose() {
    this.m.dispose();
  }
}

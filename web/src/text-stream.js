// Token ids in; text, stop-string detection and printable pieces out (gpt2edge.runtime.model.tokenizer.TextStream).
//
// Decoding is UTF-8 safe: a character split over several byte-level tokens is held back until it is complete
// (the decode of the pending ids ends in U+FFFD until then), and only a short window of recent ids is decoded
// per token. Stop strings are matched on the decoded text, however many tokens they were split over; take()
// never hands out part of a stop string, nor a suffix that could still become one.

const REPLACEMENT = "\uFFFD";

export class StreamDecoder {
  /** tokenizer: anything with decode(ids, {skip_special_tokens}) -> string (@huggingface/tokenizers). */
  constructor(tokenizer) {
    this.tokenizer = tokenizer;
    this.ids = [];
    this.prefix = 0; // ids[prefix:read] were decoded last time, for context (a leading space, merges)
    this.read = 0; // ids before this one have been handed out
  }

  decode(ids) {
    if (!ids.length) return "";
    return this.tokenizer.decode(ids, { skip_special_tokens: true, clean_up_tokenization_spaces: false });
  }

  /** Add one token; return the new text that is now safe to print (possibly ""). */
  push(id) {
    this.ids.push(id);
    const before = this.decode(this.ids.slice(this.prefix, this.read));
    const now = this.decode(this.ids.slice(this.prefix));
    if (now.length > before.length && !now.endsWith(REPLACEMENT)) {
      this.prefix = this.read;
      this.read = this.ids.length;
      return now.slice(before.length);
    }
    return "";
  }

  /** Whatever is left at the end (an incomplete character comes out as U+FFFD, as a full decode gives it). */
  flush() {
    const before = this.decode(this.ids.slice(this.prefix, this.read));
    const now = this.decode(this.ids.slice(this.prefix));
    this.prefix = this.read = this.ids.length;
    return now.slice(before.length);
  }
}

export class TextStream {
  constructor(tokenizer, stop = []) {
    this.decoder = new StreamDecoder(tokenizer);
    this.stop = typeof stop === "string" ? [stop] : [...stop];
    this.longest = Math.max(0, ...this.stop.map((s) => s.length));
    this.all = ""; // everything decoded so far (whole characters)
    this.stopAt = null; // where the earliest stop string begins, once one has appeared
    this.taken = 0;
    this.finished = false;
  }

  /** Add one generated token; true once a stop string has appeared (later tokens are then ignored). */
  push(id) {
    if (this.stopAt === null && !this.finished) this.append(this.decoder.push(id));
    return this.stopAt !== null;
  }

  /** The row is over: release an incomplete last character. Idempotent. */
  finish() {
    if (!this.finished && this.stopAt === null) this.append(this.decoder.flush());
    this.finished = true;
  }

  /** The generated text, cut before the stop string if one was found. */
  get text() {
    return this.stopAt === null ? this.all : this.all.slice(0, this.stopAt);
  }

  /** New text that is safe to print. */
  take() {
    const end = this.stopAt !== null ? this.stopAt : this.finished ? this.all.length : this.all.length - this.held();
    const piece = this.all.slice(this.taken, Math.max(this.taken, end));
    this.taken = Math.max(this.taken, end);
    return piece;
  }

  append(piece) {
    if (!piece) return;
    // a stop string not present before must end in the new piece, so it starts at most longest-1 back
    const start = Math.max(0, this.all.length - this.longest + 1);
    this.all += piece;
    const hits = this.stop.map((s) => this.all.indexOf(s, start)).filter((i) => i >= 0);
    if (hits.length) this.stopAt = Math.min(...hits);
  }

  /** Length of the longest suffix of the untaken text that is a proper prefix of some stop string. */
  held() {
    const room = Math.min(this.longest - 1, this.all.length - this.taken);
    for (let n = room; n > 0; n--) {
      const tail = this.all.slice(-n);
      if (this.stop.some((s) => s.startsWith(tail))) return n;
    }
    return 0;
  }
}

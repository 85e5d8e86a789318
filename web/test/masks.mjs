// The JS constraint engine's masks for tests/web/test_web_constraints.py: for each case, compile the constraint
// (src/constraints.js on xgrammar), walk the token ids of its prefix, and write the allowed ids before each one
// and after the last (end tokens as the runtime allows them).
//   node test/masks.mjs IN.json OUT.json
//   IN: {"tokenizer": path to tokenizer.json, "vocab_size", "eos": [ids], "cases": [{"kind", "text", "ids"}]}
//   OUT: {"cases": [{"steps": [[allowed ids], ...], "forced": [text], "done", "compile_ms"} | {"error": "..."}],
//         "mask_ms": mean ms a generated token costs the runtime (allowed() + advance(): the mask as a
//         Uint8Array over the vocabulary, then accept the token and compute the next state's bitmask)}
import { readFileSync, writeFileSync } from "node:fs";

import "./xgrammar-node.mjs";
import { Constraint, ConstraintEngine, vocabularyOf } from "../src/constraints.js";

const [inPath, outPath] = process.argv.slice(2);
const job = JSON.parse(readFileSync(inPath, "utf8"));
const engine = await ConstraintEngine.create(vocabularyOf(JSON.parse(readFileSync(job.tokenizer, "utf8"))), job.vocab_size, job.eos);
const out = [];
let maskMs = 0, masks = 0;
for (const c of job.cases) {
  try {
    const compiled = await engine.compile(new Constraint(c.kind, c.text));
    const m = await compiled.matcher();
    const steps = [];
    const forced = [];
    for (let i = 0; i <= c.ids.length; i++) {
      forced.push(m.forcedText());
      const t0 = performance.now();
      const a = m.allowed(job.eos);
      const t1 = performance.now();
      const ids = [];
      for (let t = 0; t < a.length; t++) if (a[t]) ids.push(t);
      steps.push(ids);
      if (i < c.ids.length) {
        const t2 = performance.now();
        await m.advance(c.ids[i]);
        maskMs += t1 - t0 + (performance.now() - t2);
        masks++;
      }
    }
    out.push({ steps, forced, done: m.done, compile_ms: compiled.compileMs });
    m.dispose();
  } catch (e) {
    out.push({ error: `${e.name}: ${e.message}` });
  }
}
writeFileSync(outPath, JSON.stringify({ cases: out, mask_ms: masks ? maskMs / masks : 0 }));

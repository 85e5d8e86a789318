// xgrammar's bundle in Node: it is a UMD script in a "type": "module" package, so Node's ESM loader cannot
// import it (it runs it as a module, without `require`); here it runs as CommonJS and sets globalThis.xgrammar,
// as the page's import of vendor/xgrammar/xgrammar.js does.
//   import "./xgrammar-node.mjs";
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname } from "node:path";
import { fileURLToPath } from "node:url";

const path = fileURLToPath(new URL("../node_modules/@mlc-ai/web-xgrammar/lib/index.js", import.meta.url));
if (!globalThis.xgrammar) {
  const module = { exports: {} };
  new Function("exports", "module", "require", "__filename", "__dirname", readFileSync(path, "utf8"))(
    module.exports, module, createRequire(path), path, dirname(path),
  );
  globalThis.xgrammar = module.exports;
}

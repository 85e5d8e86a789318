// WebFolder's file names: only plain paths inside the folder, in any spelling the URL parser or a server
// could turn into something else. No browser and no server: a refused name fails before any fetch.
//   node --test test/folder.test.mjs
import assert from "node:assert/strict";
import { test } from "node:test";

import { FolderError, WebFolder, folderUrl } from "../src/folder.js";

const BASE = "http://127.0.0.1:9/site/folder/";

// every spelling of "out of the folder" or "another URL" a hostile manifest could give
export const REFUSED = [
  "../manifest.json",
  "a/../../x",
  "..",
  ".",
  "./model.onnx",
  "%2e%2e/x", // the URL parser reads %2e%2e as ".."
  "%2E%2e/x",
  "%2e%2E/%2e%2e/x",
  ".%2e/x",
  "%2e./x",
  "%2e/x",
  "%252e%252e/x", // a server that decodes twice sees ".."
  "%252E%252E%252Fx",
  "..%2fx", // an encoded slash
  "a%2F..%2F..%2Fx",
  "a%5c..%5cx", // an encoded backslash
  "..\\x",
  "a\\..\\..\\x",
  "/etc/passwd",
  "//evil.example/x", // protocol-relative
  "\\\\evil.example\\x",
  "http://evil.example/x",
  "HTTPS://evil.example/x",
  "javascript:alert(1)",
  "data:text/plain,x",
  "file:///etc/passwd",
  "a//b",
  "a/",
  "model.onnx?x=1",
  "model.onnx#x",
  "mod%00el.onnx",
  "model.onnx\u0000",
  " model.onnx",
  "model\tonnx",
  "mo\ndel.onnx",
  "\uff0e\uff0e/x", // fullwidth dots
  "x".repeat(600),
  "",
];

const ALLOWED = ["model.onnx", "model.onnx.data", "tokenizer.json", "web/src/page.js", "vendor/ort/ort.wasm.min.mjs", "a-b_c.1"];

test("folderUrl refuses every spelling of a path outside the folder", () => {
  for (const name of REFUSED) assert.equal(folderUrl(BASE, name), null, JSON.stringify(name));
  for (const name of [null, undefined, 5, ["model.onnx"], { toString: () => "model.onnx" }]) {
    assert.equal(folderUrl(BASE, name), null, String(name));
  }
});

test("folderUrl keeps plain names under the folder", () => {
  for (const name of ALLOWED) {
    const url = folderUrl(BASE, name);
    assert.ok(url, name);
    assert.equal(url.href, BASE + name);
  }
});

test("WebFolder.bytes refuses a bad name in one sentence, before any fetch", async () => {
  let fetched = 0;
  const realFetch = globalThis.fetch;
  globalThis.fetch = async () => {
    fetched += 1;
    throw new Error("no network in this test");
  };
  try {
    const files = Object.fromEntries(REFUSED.map((n) => [n, { size: 1, sha256: "0".repeat(64) }]));
    const folder = new WebFolder(BASE, { files });
    for (const name of REFUSED) {
      await assert.rejects(folder.bytes(name, "the graph"), (e) => {
        assert.ok(e instanceof FolderError, String(e));
        assert.match(e.message, /which is not a path inside the folder/);
        assert.ok(e.message.length < 300, e.message);
        return true;
      });
    }
    assert.equal(fetched, 0);
    // a good name is fetched (and here fails as a fetch, not as a name)
    await assert.rejects(new WebFolder(BASE, { files: { "model.onnx": { size: 1, sha256: "0" } } }).bytes("model.onnx"), /Cannot fetch/);
    assert.equal(fetched, 1);
  } finally {
    globalThis.fetch = realFetch;
  }
});

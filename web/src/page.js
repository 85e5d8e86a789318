// The page: pick a backend (WebGPU, else WASM; threads when the page is cross-origin isolated), load the folder
// the page sits in, and generate from the form, or from the query string for automation:
//   index.html?prompt=TEXT&max_new_tokens=N&temperature=0[&seed=S&top_k=K&top_p=P&repetition_penalty=R
//              &stop=S (repeatable)&ignore_eos=1&device=wasm|webgpu&threads=T
//              &json_schema=JSON|&json_object=1|&regex=RE|&choice=S (repeatable)|&grammar=GBNF]&report=URL
// generates on load and POSTs {"token_ids", "text", "prefill_ms", "decode_ms_per_token", ...} as JSON to URL
// (same origin only), or {"error": "..."} when anything fails.

import { WebGenerator } from "./generator.js";

const $ = (id) => document.getElementById(id);
const vendor = new URL("../vendor/ort/", import.meta.url);
const folderBase = new URL("../", import.meta.url);

const state = { generator: null, controller: null, notes: [], device: null, threads: 1, loadMs: 0, bytes: 0 };
window.gpt2edge = state; // for the console and the tests

function note(text) {
  state.notes.push(text);
  const li = document.createElement("li");
  li.textContent = text;
  $("notes").append(li);
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
  $("status").textContent = "error";
}

async function webgpuAdapter() {
  if (!("gpu" in navigator)) return null;
  try {
    return await navigator.gpu.requestAdapter();
  } catch {
    return null;
  }
}

async function importOrt(device, threads) {
  const ort = await import(new URL(device === "webgpu" ? "ort.webgpu.min.mjs" : "ort.wasm.min.mjs", vendor).href);
  ort.env.wasm.wasmPaths = vendor.href;
  ort.env.wasm.numThreads = threads;
  ort.env.logLevel = "error";
  return ort;
}

/** Threads: as asked, or up to 4; one when the page is not cross-origin isolated (no SharedArrayBuffer). */
function pickThreads(asked) {
  if (!globalThis.crossOriginIsolated) {
    const why = location.protocol === "file:" ? "the page was opened from file://" : "the server sent no COOP/COEP headers";
    note(`One WASM thread: ${why}, so the page is not cross-origin isolated and WASM threads are off. Serve the folder with the headers (see serve.py in this folder) for multi-threaded decoding.`);
    return 1;
  }
  const n = asked ?? Math.min(4, navigator.hardwareConcurrency || 1);
  return Math.max(1, n);
}

async function load(query) {
  const t0 = performance.now();
  state.threads = pickThreads(query.threads);
  let device = query.device ?? "auto";
  if (device !== "wasm") {
    const adapter = await webgpuAdapter();
    if (!adapter) {
      if (device === "webgpu") throw new Error("device=webgpu was asked for, but this browser has no WebGPU adapter; drop device= to run on WASM.");
      note("WebGPU is not available in this browser: running on WASM (CPU).");
      device = "wasm";
    } else {
      device = "webgpu";
    }
  }
  const onBytes = (n) => (state.bytes += n);
  let generator;
  try {
    generator = await WebGenerator.load(await importOrt(device, state.threads), folderBase, { device, onBytes });
  } catch (e) {
    if (device !== "webgpu" || query.device === "webgpu" || e.name === "FolderError") throw e;
    note(`WebGPU could not run this graph (${e.message}): running on WASM (CPU).`);
    device = "wasm";
    state.bytes = 0;
    generator = await WebGenerator.load(await importOrt(device, state.threads), folderBase, { device, onBytes });
  }
  state.device = device;
  state.generator = generator;
  state.loadMs = performance.now() - t0;
  const g = generator.folder.manifest.graph;
  // a hub id as it is (org/name), a local checkpoint by its folder name (not the converting machine's path)
  const src = generator.folder.manifest.source ?? {};
  const model = String(src.model ?? "model").replace(/\/+$/, "");
  $("model").textContent = `${src.kind === "local" ? model.split("/").pop() : model} · ${g.precision} · ${g.kv_cache} cache`;
  $("backend").textContent = device === "webgpu" ? "WebGPU" : `WASM, ${state.threads} thread${state.threads > 1 ? "s" : ""}`;
  $("status").textContent = `ready (loaded in ${(state.loadMs / 1e3).toFixed(1)} s)`;
}

/** The form's constraint: {json_schema: text} etc. (constraints.js's Constraint.from), or undefined. */
function formConstraint() {
  const kind = $("constraint_kind").value;
  const text = $("constraint_text").value;
  if (!kind) return undefined;
  if (kind === "json_object") return { json_object: true };
  if (kind === "choice") return { choice: text.split("\n").filter((s) => s.length) };
  return { [kind]: text };
}

/** The query string's constraint (one of json_schema, json_object, regex, choice, grammar), or undefined. */
function queryConstraint(q) {
  const given = ["json_schema", "json_object", "regex", "choice", "grammar"].filter((k) => q.has(k));
  if (!given.length) return undefined;
  const c = {};
  for (const k of given) c[k] = k === "choice" ? q.getAll(k) : k === "json_object" ? q.get(k) === "1" : q.get(k);
  return c; // more than one: the generator refuses it in one line
}

function showConstraint(c) {
  if (!c) return;
  const [kind, value] = Object.entries(c)[0];
  $("constraint_kind").value = kind;
  $("constraint_text").value = kind === "choice" ? value.join("\n") : kind === "json_object" ? "" : value;
}

function formOptions() {
  const num = (id) => ($(id).value.trim() === "" ? undefined : Number($(id).value));
  // one stop string a line; a literal \n in a line stands for a newline
  const stop = $("stop").value.split("\n").filter((s) => s.length).map((s) => s.replaceAll("\\n", "\n"));
  return {
    max_new_tokens: num("max_new_tokens"),
    temperature: num("temperature"),
    top_k: num("top_k"),
    top_p: num("top_p"),
    repetition_penalty: num("repetition_penalty"),
    seed: num("seed"),
    stop,
    constraint: formConstraint(),
  };
}

async function generate(prompt, options) {
  const gen = state.generator;
  state.controller = new AbortController();
  $("stop-button").disabled = false;
  $("generate").disabled = true;
  $("error").hidden = true;
  $("output-prompt").textContent = prompt;
  $("output-text").textContent = "";
  $("status").textContent = "generating";
  const t0 = performance.now();
  let n = 0;
  try {
    const it = gen.stream(prompt, options, state.controller.signal);
    for (;;) {
      const { value, done } = await it.next();
      if (done) {
        $("tps").textContent = `${value.tokens_per_s.toFixed(1)} tokens/s · prefill ${value.prefill_ms.toFixed(0)} ms · ${value.decode_ms_per_token.toFixed(1)} ms/token`;
        $("status").textContent = `done (${value.finish_reason})`;
        return value;
      }
      n++;
      $("output-text").textContent += value.piece;
      $("tps").textContent = `${(n / ((performance.now() - t0) / 1e3)).toFixed(1)} tokens/s`;
    }
  } finally {
    $("stop-button").disabled = true;
    $("generate").disabled = false;
  }
}

function readQuery() {
  const q = new URLSearchParams(location.search);
  if (!q.has("prompt")) return null;
  const num = (k) => (q.has(k) ? Number(q.get(k)) : undefined);
  const seed = q.get("seed");
  return {
    prompt: q.get("prompt"),
    report: q.get("report"),
    device: q.get("device") ?? undefined,
    threads: num("threads"),
    options: {
      max_new_tokens: num("max_new_tokens"),
      temperature: num("temperature"),
      top_k: num("top_k"),
      top_p: num("top_p"),
      min_p: num("min_p"),
      repetition_penalty: num("repetition_penalty"),
      seed: seed === null ? undefined : /^\d+$/.test(seed) ? (Number(seed) <= Number.MAX_SAFE_INTEGER ? Number(seed) : BigInt(seed)) : Number.NaN,
      stop: q.getAll("stop"),
      ignore_eos: q.get("ignore_eos") === "1" || undefined,
      constraint: queryConstraint(q),
    },
  };
}

/** Bytes this page has fetched (scripts, wasm, graph, tokenizer), as the Resource Timing API counts them. */
function downloadedBytes() {
  const entries = [...performance.getEntriesByType("navigation"), ...performance.getEntriesByType("resource")];
  return entries.reduce((sum, e) => sum + (e.encodedBodySize || 0), 0);
}

async function report(url, body) {
  const target = new URL(url, location.href);
  if (target.origin !== location.origin) throw new Error(`report= must be on this page's origin (${location.origin}), got ${target.origin}.`);
  await fetch(target, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
}

async function main() {
  clearTimeout(window.gpt2edgeBootTimer);
  const job = readQuery();
  const q = new URLSearchParams(location.search);
  if (q.has("device")) $("device-note").textContent = `device=${q.get("device")}`;
  $("stop-button").onclick = () => state.controller?.abort();
  $("generate").onclick = () => generate($("prompt").value, formOptions()).catch((e) => showError(e.message));
  try {
    await load(job ?? { device: q.get("device") ?? undefined, threads: q.has("threads") ? Number(q.get("threads")) : undefined });
    $("generate").disabled = false;
  } catch (e) {
    showError(e.message);
    if (job?.report) await report(job.report, { error: e.message, notes: state.notes }).catch(() => {});
    return;
  }
  if (!job) return;
  $("prompt").value = job.prompt;
  for (const [k, v] of Object.entries(job.options)) if ($(k) && v !== undefined && typeof v !== "object") $(k).value = String(v);
  $("stop").value = job.options.stop.map((s) => s.replaceAll("\n", "\\n")).join("\n");
  showConstraint(job.options.constraint);
  try {
    const r = await generate(job.prompt, job.options);
    state.result = r;
    if (job.report) {
      await report(job.report, {
        ...r,
        device: state.device,
        threads: state.threads,
        load_ms: state.loadMs,
        model_bytes: state.bytes,
        bytes_downloaded: downloadedBytes(),
        notes: state.notes,
      });
    }
  } catch (e) {
    showError(e.message);
    if (job.report) await report(job.report, { error: e.message, notes: state.notes }).catch(() => {});
  }
}

main().finally(() => (state.done = true));

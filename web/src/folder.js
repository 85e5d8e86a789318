// A `gpt2edge convert --format web` folder as the page sees it: manifest.json says what every file is, and
// every file the runtime loads is checked against the manifest's sha256 before it is used.

export class FolderError extends Error {
  constructor(message) {
    super(message);
    this.name = "FolderError";
  }
}

const HEX = Array.from({ length: 256 }, (_, i) => i.toString(16).padStart(2, "0"));

async function sha256Hex(bytes) {
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
  let out = "";
  for (const b of digest) out += HEX[b];
  return out;
}

// A file name the manifest may give: plain segments of letters, digits, "_", "-" and "." (never first), one "/"
// between them. Nothing the URL parser or a server would read as something else: no "%" (so no "%2e%2e",
// which the parser turns into "..", no "%2f", no "%252e" a server decodes twice), no "\\", ":", "?", "#",
// no leading "/" or "//host", no "." or ".." segment.
const SAFE_NAME = /^[A-Za-z0-9_-][A-Za-z0-9._-]*(\/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$/;

/** The URL of `name` inside the folder at `base`, or null when `name` is not a plain path inside it. */
export function folderUrl(base, name) {
  if (typeof name !== "string" || name.length > 512 || !SAFE_NAME.test(name)) return null;
  const root = new URL(base);
  const url = new URL(name, root);
  // and what the parser made of it must still lie under the folder, on the same origin
  return url.origin === root.origin && url.pathname.startsWith(root.pathname) && !url.search && !url.hash ? url : null;
}

export class WebFolder {
  /** base: the folder's URL (ends with "/"); manifest: its parsed manifest.json. */
  constructor(base, manifest) {
    this.base = base;
    this.manifest = manifest;
    this.bytesFetched = 0;
  }

  static async open(base) {
    const url = new URL("manifest.json", base);
    let res;
    try {
      res = await fetch(url);
    } catch (e) {
      throw new FolderError(`Cannot read ${url} (${e.message}); serve the folder over http (python -m http.server is enough).`);
    }
    if (!res.ok) throw new FolderError(`${url} is missing (HTTP ${res.status}); this page needs the folder that \`gpt2edge convert --format web\` wrote.`);
    let manifest;
    try {
      manifest = await res.json();
    } catch {
      throw new FolderError(`${url} is not JSON; convert the export again.`);
    }
    const graph = manifest?.graph;
    if (manifest?.format !== "gpt2edge-export" || typeof graph !== "object" || graph === null || typeof manifest.files !== "object") {
      throw new FolderError(`${url} is not a gpt2edge manifest; convert the export again.`);
    }
    if (graph.format !== "web") {
      throw new FolderError(`This folder's graph is in the '${graph.format}' format; the page runs folders written by \`gpt2edge convert --format web\`.`);
    }
    return new WebFolder(base, manifest);
  }

  get dims() {
    return this.manifest.dims;
  }

  get graph() {
    return this.manifest.graph;
  }

  /** The bytes of `name` (a path relative to the folder), after checking its size and sha256. */
  async bytes(name, what = name) {
    // a path inside the folder only, in any spelling (the manifest came from the server): see SAFE_NAME
    const url = folderUrl(this.base, name);
    if (url === null) {
      const shown = typeof name === "string" ? JSON.stringify(name.slice(0, 80)) : typeof name;
      throw new FolderError(`manifest.json names ${what} as ${shown}, which is not a path inside the folder; convert the export again.`);
    }
    const entry = this.manifest.files[name];
    if (!entry) throw new FolderError(`manifest.json does not list ${what} (${name}); convert the export again.`);
    let res;
    try {
      res = await fetch(url);
    } catch (e) {
      throw new FolderError(`Cannot fetch ${what} (${name}): ${e.message}.`);
    }
    if (!res.ok) throw new FolderError(`${what} (${name}) is missing from the folder (HTTP ${res.status}); copy the whole folder, or convert the export again.`);
    const bytes = new Uint8Array(await res.arrayBuffer());
    this.bytesFetched += bytes.byteLength;
    if (bytes.byteLength !== entry.size || (await sha256Hex(bytes)) !== entry.sha256) {
      throw new FolderError(`${what} (${name}) does not match the sha256 in manifest.json: the file was changed or truncated; convert the export again.`);
    }
    return bytes;
  }

  async json(name, what = name) {
    const text = new TextDecoder().decode(await this.bytes(name, what));
    try {
      return JSON.parse(text);
    } catch {
      throw new FolderError(`${what} (${name}) is not valid JSON; convert the export again.`);
    }
  }

  /** generation_config.json when the manifest lists it, else {}. */
  async generationDefaults() {
    return "generation_config.json" in this.manifest.files ? this.json("generation_config.json", "the generation config") : {};
  }
}

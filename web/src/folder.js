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
    // a path inside the folder only: no absolute path, no "..", no URL (the manifest came from the server)
    if (typeof name !== "string" || !name || name.startsWith("/") || name.includes(":") || name.includes("\\") || name.split("/").includes("..")) {
      throw new FolderError(`manifest.json names ${what} as ${JSON.stringify(name)}, which is not a path inside the folder; convert the export again.`);
    }
    const entry = this.manifest.files[name];
    if (!entry) throw new FolderError(`manifest.json does not list ${what} (${name}); convert the export again.`);
    let res;
    try {
      res = await fetch(new URL(name, this.base));
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

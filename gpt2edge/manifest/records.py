"""The typed records of a manifest.json: the model dims, the graph (and a static export's two graphs), a trimmed
vocabulary, the file digests, and the constants naming the graph kinds a manifest may describe.

`Manifest.from_json` turns the JSON into frozen, validated records: every path the folder names is a plain
relative path that stays inside the folder, and every file that is loaded (graph, its external data, tokenizer,
generation config) is listed with a checksum. Pure: no file is read here (gpt2edge.manifest reads, writes and
verifies folders). No torch or onnx import: the runtime uses this on the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import PurePosixPath
from types import MappingProxyType
from typing import Any

from gpt2edge import __version__
from gpt2edge.errors import ModelFolderError
from gpt2edge.manifest.fields import Fields, check_io, check_records, read_digest, shown_path

MANIFEST_NAME = "manifest.json"
# a manifest is a few kB; past this it is refused unread (a hostile folder could hold a 10 GB sparse file)
MAX_MANIFEST_BYTES = 16 << 20
FORMAT = "gpt2edge-export"
FORMAT_VERSION = 1
GENERATION_CONFIG = "generation_config.json"

# graph.precision (export writes fp32, quantize the others) and graph.kv_dtype
PRECISIONS = ("fp32", "fp16", "int8", "int4")
KV_DTYPES = ("float32", "float16", "int8")
# graph kinds a manifest may describe (graph.head, graph.kv_cache), and what computes attention in each
# (graph.attention): the exporter writes these, the CLI offers them, the runtime checks them
HEAD_MODES = ("last", "all", "tail")
KEEP_INPUT = "logits_to_keep"  # the tail head's input: the positions whose log-probs the graph returns
KV_CACHE_MODES = ("concat", "shared")
ATTENTION_OPS = {"concat": "onnx", "shared": "com.microsoft.GroupQueryAttention"}
# graph.format: "onnx" (export, quantize), "ort" (ONNX Runtime's flatbuffer, for minimal builds) and "genai"
# (an ONNX graph in onnxruntime-genai's IO contract, run by genai, not by gpt2edge's runtime), "web" (an ONNX graph
# in the form onnxruntime-web runs, beside a page; the Python runtime runs it too); see gpt2edge.convert
GRAPH_FORMATS = ("onnx", "ort", "genai", "web")
# graph.kv_cache of a static-shape export (`export --static`): a fixed-capacity cache written by position,
# described by graph.static (StaticInfo); not a --kv-cache choice
STATIC_KV_CACHE = "static"


@dataclass(frozen=True)
class DerivedKind:
    """A folder-to-folder command: the manifest field that records how its folder was made from the parent, and
    whether the parent's quality report still describes the new graph."""

    record: str
    keeps_quality: bool  # True only where the graph computes the parent's numbers (a format conversion)


# every derived folder (gpt2edge.folder.derive) by the command that makes it
DERIVED_KINDS: Mapping[str, DerivedKind] = MappingProxyType(
    {
        "quantize": DerivedKind("quantization", keeps_quality=False),  # new weights: its own report, or none
        "trim-vocab": DerivedKind("trim", keeps_quality=False),  # a new head: its report is under trim.quality
        "sparse-head": DerivedKind("sparse_head", keeps_quality=False),  # a new head (cluster: approximate)
        "convert": DerivedKind("conversion", keeps_quality=True),  # the same graph in another format
    }
)
# what a derived manifest never takes from its parent's: `files` and `format*` are written anew for the new folder
# (gpt2edge.manifest.write_manifest), `validation` measured the parent's graph against PyTorch, not this one
DERIVED_DROPS = ("files", "format", "format_version", "validation")


def check_relpath(value: Any, where: str, field: str = "") -> str:
    """A path named by a manifest (in `field`, e.g. "graph.file"): a normalised relative POSIX path with no '..',
    or a ModelFolderError."""
    bad = None
    if not isinstance(value, str) or not value:
        bad = "is not a file name"
    elif "\0" in value or "\\" in value or ":" in value:
        bad = "has a NUL byte, backslash or colon"
    else:
        p = PurePosixPath(value)
        if p.is_absolute():
            bad = "is absolute"
        elif not p.parts or ".." in p.parts or p.as_posix() != value:
            bad = "leaves the folder or is not normalised"
    if bad:
        named = f"{field}: " if field else ""
        raise ModelFolderError(
            f"{where}: {named}the path {shown_path(value, quoted=True)} {bad}; a model folder names only files inside "
            "it (re-export the model)."
        )
    return value


@dataclass(frozen=True)
class ModelDims:
    """The model dimensions the runtime needs; `dims["n_layer"]` still works for older callers."""

    n_layer: int
    n_head: int
    n_embd: int
    head_dim: int
    vocab_size: int
    n_positions: int
    n_inner: int
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_new"
    attn_scale_by_layer: bool = False
    scale_attn_weights: bool = True

    @classmethod
    def from_json(cls, d: Any, where: str) -> ModelDims:
        f = Fields(d, "dims", where)
        ints = {k: f.integer(k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")}
        return cls(
            **ints,
            # older manifests lack these two: derived as GPT-2 does
            head_dim=f.integer("head_dim", ints["n_embd"] // ints["n_head"]),
            n_inner=f.integer("n_inner", 4 * ints["n_embd"]),
            layer_norm_epsilon=f.number("layer_norm_epsilon", cls.layer_norm_epsilon),
            activation=f.text("activation", cls.activation),
            attn_scale_by_layer=f.flag("attn_scale_by_layer", cls.attn_scale_by_layer),
            scale_attn_weights=f.flag("scale_attn_weights", cls.scale_attn_weights),
        )

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self.keys() else default

    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StaticInfo:
    """A static-shape export (graph.static): every call takes `batch` rows; the prefill graph takes `chunk`
    tokens, the decode graph one (the same file when chunk is 1); the cache holds `capacity` positions."""

    batch: int
    chunk: int
    capacity: int
    prefill_file: str
    decode_file: str

    @classmethod
    def from_json(cls, s: Any, where: str) -> StaticInfo | None:
        if s is None:
            return None
        f = Fields(s, "graph.static", where)
        batch, chunk, capacity = (f.integer(k) for k in ("batch", "chunk", "capacity"))
        if chunk > capacity:
            raise ModelFolderError(f"{where}: graph.static.chunk exceeds its capacity; re-export the model.")
        prefill = check_relpath(f.text("prefill_file"), where, "graph.static.prefill_file")
        decode = check_relpath(f.text("decode_file"), where, "graph.static.decode_file")
        if (decode == prefill) != (chunk == 1):
            raise ModelFolderError(f"{where}: graph.static needs its own decode graph unless chunk is 1; re-export.")
        return cls(batch, chunk, capacity, prefill, decode)


@dataclass(frozen=True)
class GraphInfo:
    """The ONNX graph of a folder: its files (the .onnx first) and what kind of graph it is."""

    file: str
    files: tuple[str, ...]
    head: str = "last"
    kv_cache: str = "concat"
    attention: str | None = None
    precision: str = "fp32"
    kv_dtype: str = "float32"
    opset: int | None = None
    decode_weight_bytes: int | None = None
    format: str = "onnx"  # GRAPH_FORMATS: "ort" and "genai" folders come from `gpt2edge convert`
    static: StaticInfo | None = None  # set for a static-shape export (kv_cache STATIC_KV_CACHE)

    @classmethod
    def from_json(cls, g: Any, where: str) -> GraphInfo:
        f = Fields(g, "graph", where)
        file = check_relpath(f.text("file"), where, "graph.file")
        files = f.items("files", [file])
        if file not in files:
            raise ModelFolderError(f"{where}: graph.files must be a list that holds graph.file; re-export the model.")
        f.flag("tied_lm_head", None)  # what export wrote; read by nothing yet
        check_io(f, "inputs")  # read by quantize, trim-vocab and convert
        check_io(f, "outputs")
        info = cls(
            file=file,
            files=tuple(check_relpath(name, where, f"graph.files[{i}]") for i, name in enumerate(files)),
            head=f.text("head", cls.head, choices=HEAD_MODES),
            kv_cache=f.text("kv_cache", cls.kv_cache, choices=(*KV_CACHE_MODES, STATIC_KV_CACHE)),
            attention=f.text("attention", None, choices=tuple(ATTENTION_OPS.values()), nullable=True),
            precision=f.text("precision", cls.precision, choices=PRECISIONS),
            kv_dtype=f.text("kv_dtype", cls.kv_dtype, choices=KV_DTYPES),
            opset=f.integer("opset", None, nullable=True),
            decode_weight_bytes=f.integer("decode_weight_bytes", None, min=0, nullable=True),
            format=f.text("format", cls.format, choices=GRAPH_FORMATS),
            static=StaticInfo.from_json(g.get("static"), where),
        )
        info._check_static(where)
        return info

    def _check_static(self, where: str) -> None:
        """graph.static and kv_cache "static" come together, on a last-position ONNX graph whose files hold
        both graphs (graph.file is the prefill graph)."""
        s = self.static
        if (s is None) != (self.kv_cache != STATIC_KV_CACHE):
            raise ModelFolderError(f"{where}: graph.kv_cache 'static' needs graph.static (and back); re-export.")
        if s is None:
            return
        if self.head != "last" or self.format != "onnx":
            raise ModelFolderError(f"{where}: a static graph must be an ONNX graph with head 'last'; re-export.")
        if self.file != s.prefill_file or s.decode_file not in self.files:
            raise ModelFolderError(
                f"{where}: graph.file must be graph.static.prefill_file and graph.files must hold its decode_file; "
                "re-export the model."
            )


@dataclass(frozen=True)
class VocabInfo:
    """A vocabulary-trimmed head (`gpt2edge trim-vocab`): the graph's log-probs cover `kept` of the `full` token
    ids, listed ascending in `kept_ids_file` (.npy, int64); the runtime maps them back to full ids. Its presence
    is what marks a folder as trimmed (e.g. to refuse it as a draft for an untrimmed target)."""

    kept_ids_file: str
    kept: int
    full: int

    @classmethod
    def from_json(cls, v: Any, where: str, vocab_size: int) -> VocabInfo | None:
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ModelFolderError(f"{where}: 'vocab' must describe the kept token ids; trim the model again.")
        f = Fields(v, "vocab", where, fix="trim the model again")
        file = check_relpath(f.text("kept_ids_file"), where, "vocab.kept_ids_file")
        kept, full = f.integer("kept"), f.integer("full")
        if full != vocab_size or kept > full:
            raise ModelFolderError(
                f"{where}: vocab keeps {kept} of {full} ids but the model has {vocab_size}; trim the model again."
            )
        return cls(file, kept, full)


@dataclass(frozen=True)
class FileDigest:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest.json; `raw` keeps the JSON for fields nothing reads typed (source, reports)."""

    format_version: int
    dims: ModelDims
    graph: GraphInfo
    tokenizer: str
    files: Mapping[str, FileDigest]
    raw: Mapping[str, Any]
    vocab: VocabInfo | None = None  # set for a vocabulary-trimmed head

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST_NAME) -> Manifest:
        """Check the format and every path and checksum entry; a ModelFolderError says what is wrong."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ModelFolderError(f"{where} is not a gpt2edge manifest; re-export the model with `gpt2edge export`.")
        top = Fields(data, "", where)
        version = data.get("format_version")
        if type(version) is int and version > FORMAT_VERSION:
            raise ModelFolderError(
                f"{where} was written by a newer gpt2edge (manifest format {version!r}); upgrade gpt2edge."
            )
        top.integer("format_version", max=FORMAT_VERSION)
        files = {}
        for rel, d in top.record("files").data.items():
            check_relpath(rel, where, "files")
            files[rel] = FileDigest(*read_digest(d, rel, where))
        graph = GraphInfo.from_json(top.record("graph").data, where)
        tokenizer = check_relpath(top.text("tokenizer", "tokenizer.json"), where, "tokenizer")
        # every file that is loaded must be checksummed, or --verify would not cover it
        for rel in (*graph.files, tokenizer):
            if rel not in files:
                raise ModelFolderError(
                    f"{where}: {shown_path(rel)} is loaded but not listed in 'files'; re-export the model."
                )
        dims = ModelDims.from_json(top.record("dims").data, where)
        check_records(top)
        if graph.static is not None and graph.static.capacity > dims.n_positions:
            raise ModelFolderError(f"{where}: graph.static.capacity exceeds dims.n_positions; re-export the model.")
        vocab = VocabInfo.from_json(data.get("vocab"), where, dims.vocab_size)
        if vocab is not None and vocab.kept_ids_file not in files:
            raise ModelFolderError(
                f"{where}: {shown_path(vocab.kept_ids_file)} is loaded but not listed in 'files'; trim again."
            )
        return cls(version, dims, graph, tokenizer, MappingProxyType(files), MappingProxyType(data), vocab)

    def loaded_files(self) -> tuple[str, ...]:
        """Every file the runtime opens: the graph files, the tokenizer, the kept ids of a trimmed head, the
        generation config when listed."""
        extra = (GENERATION_CONFIG,) if GENERATION_CONFIG in self.files else ()
        kept = (self.vocab.kept_ids_file,) if self.vocab else ()
        return (*self.graph.files, self.tokenizer, *kept, *extra)

    def derived(
        self, kind: str, parent_path: str, *, graph: Mapping[str, Any], record: Mapping[str, Any], **fields: Any
    ) -> dict[str, Any]:
        """The manifest of a folder made from this one (the folder at `parent_path`, resolved) by command `kind`
        (DERIVED_KINDS), before its checksums: this manifest less DERIVED_DROPS (and its quality report unless
        the kind keeps it), `graph` over this graph's fields, the kind's record with its `parent` (path, precision
        and the graph files' sha256), the version and time of writing, then `fields` (e.g. a vocab record)."""
        kind_of = DERIVED_KINDS[kind]
        drops = DERIVED_DROPS if kind_of.keeps_quality else (*DERIVED_DROPS, "quality")
        manifest = {k: v for k, v in self.raw.items() if k not in drops}
        parent = {
            "path": parent_path,
            "precision": self.graph.precision,
            "sha256": {f: self.files[f].sha256 for f in self.graph.files},
        }
        manifest.update(
            gpt2edge_version=__version__,
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            graph={**self.raw["graph"], **graph},
            **{kind_of.record: {**record, "parent": parent}},
        )
        manifest.update(fields)
        return manifest

    def model_bytes(self) -> int:
        """Bytes of the graph files (the .onnx and its external data)."""
        return sum(self.files[f].size for f in self.graph.files)

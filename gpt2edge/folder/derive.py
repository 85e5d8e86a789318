"""The skeleton every command that writes a model folder follows; each handler keeps only its rewrite and its record.

`Output` is the folder being written (export's and every derived folder's): OUT checked before any work, the
memory and disk the work needs checked against the machine, then the atomic temp folder that becomes OUT only
when complete (gpt2edge.folder). `Derivation` is a folder made from another one (quantize, trim-vocab,
sparse-head, convert): the parent's manifest read typed, OUT kept apart from it, every checksum verified before
the work, the files every derived folder carries copied, and the new manifest made by `Manifest.derived` (one
list of what a derived manifest drops from its parent's and why: gpt2edge.manifest.records.DERIVED_KINDS).

    d = Derivation(src, out, "quantize", force=force)   # reads the parent; OUT apart from it
    ...the handler's own refusals, on d.parent...
    d.ready(need)                                       # OUT, memory and disk, then every checksum
    with d.output() as tmp:
        files = ...the rewrite, written into tmp...
        d.copy_side_files(tmp)
        manifest = d.write_manifest(tmp, graph={...}, record={...})
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpt2edge.api_args import path_arg
from gpt2edge.budget.needs import Need, check_need
from gpt2edge.folder import atomic_output_dir
from gpt2edge.folder.checks import check_output_dir, check_sources
from gpt2edge.manifest import load_manifest, resolve_inside, verify_files, write_manifest
from gpt2edge.manifest.records import DERIVED_KINDS, Manifest


class Output:
    """The folder a command writes: checked before the work, written atomically."""

    def __init__(self, out: str | Path, *, force: bool = False, sources: Iterable[str | Path | None] = ()) -> None:
        self.out = path_arg(out, "out")  # a TypeError names a wrong type
        self.force = force
        self.sources = list(sources)  # inputs OUT must not be, lie in or hold (--force would delete them)

    def check(self, need: Need | None = None) -> None:
        """OUT (absent, or replaceable with --force; apart from the inputs), then the memory and disk `need`."""
        check_output_dir(self.out, self.force, self.sources)
        if need is not None:
            check_need(need, self.out)

    @contextmanager
    def output(self) -> Iterator[Path]:
        """A temp folder beside OUT that becomes OUT on success and is removed on any failure."""
        with atomic_output_dir(self.out, force=self.force, sources=self.sources) as tmp:
            yield tmp


class Derivation(Output):
    """A folder derived from export folder `src` by command `kind` (a key of DERIVED_KINDS)."""

    def __init__(self, src: str | Path, out: str | Path, kind: str, *, force: bool = False) -> None:
        if kind not in DERIVED_KINDS:  # a programming error, not a user's
            raise ValueError(f"unknown derived folder kind {kind!r}; one of {', '.join(DERIVED_KINDS)}")
        self.src = path_arg(src, "src")
        super().__init__(out, force=force, sources=[self.src])
        self.kind = kind
        self.parent: Manifest = load_manifest(self.src)  # validated; every path it names stays inside src
        check_sources(self.out, [self.src])  # OUT equal to, inside or holding the parent: refused before anything

    def ready(self, need: Need | None = None) -> None:
        """The last checks before the work: OUT, the memory and disk `need`, then every file's sha256."""
        self.check(need)
        verify_files(self.src, self.parent)

    def copy_side_files(self, tmp: Path) -> None:
        """The parent's files that are not its graph (tokenizer, configs, the report text), copied unchanged."""
        for name in self.parent.files:
            if name not in self.parent.graph.files:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(resolve_inside(self.src, name), tmp / name)

    def manifest(self, *, graph: dict[str, Any], record: dict[str, Any], **fields: Any) -> dict[str, Any]:
        """The new folder's manifest before its checksums (Manifest.derived)."""
        return self.parent.derived(self.kind, str(self.src.resolve()), graph=graph, record=record, **fields)

    def write_manifest(
        self, tmp: Path, *, graph: dict[str, Any], record: dict[str, Any], **fields: Any
    ) -> dict[str, Any]:
        """Write the new folder's manifest, with every file's checksum, into `tmp`; returns it."""
        return write_manifest(tmp, self.manifest(graph=graph, record=record, **fields))

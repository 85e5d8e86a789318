"""The one factory that opens a folder's graph: the kind its manifest names (a static export, a sparse or an
approximate head, or the plain dynamic graph). It sits above runtime/model and runtime/sparse_head, so the model
room imports nothing from the sparse head's; every caller gets a runtime/model/contract.py Graph. GraphLoading
starts that load on a thread (OnThread), for a caller with other work to do meanwhile (the CLI: its imports)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Generic, TypeVar

from gpt2edge.runtime.model.contract import Graph
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.lm import OrtGraph
from gpt2edge.runtime.model.static_lm import StaticGraph
from gpt2edge.runtime.sparse_head.approx import ApproxGraph
from gpt2edge.runtime.sparse_head.lm import SparseGraph


def load_graph(
    folder: ModelFolder, device: str = "cpu", threads: int | None = None, spin: bool = True, lean: bool = False
) -> Graph:
    """The folder's graph, loaded as its manifest says: a StaticGraph for a static-shape export, a SparseGraph or
    an ApproxGraph on the body OrtGraph for a sparse-head folder, else an OrtGraph. Each one's `new_lm()` makes a
    generation context (the LM contract). spin=False: idle intra-op threads sleep (a draft model alternates with
    this graph token by token). lean: create_session's."""
    if folder.graph.static is not None:
        return StaticGraph.from_folder(folder, device=device, threads=threads, lean=lean)
    rec = folder.info.raw.get("sparse_head")
    if rec is None:
        return OrtGraph(folder, device=device, threads=threads, spin=spin, lean=lean)
    # the body here, the head in runtime/sparse_head: an approximate mode, or the exact certified head
    body = OrtGraph(folder, device=device, threads=threads, spin=spin, output="hidden", lean=lean)
    if isinstance(rec, dict) and rec.get("mode", "exact") != "exact":
        return ApproxGraph(body, device=device, threads=threads, spin=spin)
    return SparseGraph(body, device=device, threads=threads, spin=spin)


class GraphLoading:
    """A folder opened (checked on the caller's thread: its errors come first) and its graph loading on a thread
    from then on, for Generator(loading=...).

    ONNX Runtime builds a session (parsing, optimizing, pre-packing the weights) without holding the GIL, so Python
    work on the caller's thread runs on the other core meanwhile: `gpt2edge generate` starts one before it
    imports the decoding modules, which then cost no wall time (a GPT-2 small int8 cached start: ~0.2 s of
    session hidden behind them; benchmarks/README.md, **Cold start**). ONNX Runtime takes the GIL back once,
    between reading the graph and initializing it, so a call that holds the GIL for long (tokenizers loading
    tokenizer.json) belongs after such imports, not right after the start. device, threads, spin: load_graph's.
    start=False: the folder is checked now and the load begins at start() (`gpt2edge serve` binds its port in
    between, so that a port in use is reported before any load)."""

    def __init__(
        self, model_dir: str | Path, verify: bool | str = True, device: str = "cpu", threads: int | None = None,
        spin: bool = True, start: bool = True,
    ) -> None:  # fmt: skip
        self.folder = ModelFolder.open(model_dir, verify=verify)
        self.verify = verify
        self.options = dict(device=device, threads=threads, spin=spin)  # what Generator(loading=...) checks
        self._graph = OnThread(self._load, "gpt2edge-load-graph")
        if start:
            self.start()

    def _load(self) -> Graph:
        return load_graph(self.folder, **self.options)

    def start(self) -> None:
        """Begin the load on its thread (once: a second call does nothing)."""
        self._graph.start()

    def result(self) -> Graph:
        """The graph, once loaded (the load's own error if it failed); a load not yet started starts now."""
        return self._graph.result()

    def wait(self) -> None:
        """Return once the load has ended, loaded or failed, or at once if it never started (an error path that
        must not leave ONNX Runtime building a session while the process exits)."""
        self._graph.wait()


T = TypeVar("T")


class OnThread(Generic[T]):
    """build() run once on a daemon thread named `name`, from start() on; its value, or the error it raised, is
    result()'s on the caller's thread. A start-up step that runs beside the caller's own work (GraphLoading's
    graph, `gpt2edge serve`'s scheduler)."""

    def __init__(self, build: Callable[[], T], name: str) -> None:
        self._build, self._name = build, name
        self._value: Future[T] = Future()
        self._started = threading.Lock()  # held once the thread has been started

    def start(self) -> None:
        """Begin on the thread (once: a second call does nothing)."""
        if self._started.acquire(blocking=False):
            # daemon: a process that ends without waiting for it (a second Ctrl-C) is not held open by it
            try:
                threading.Thread(target=self._run, name=self._name, daemon=True).start()
            except BaseException as e:  # no thread to be had: result() raises it, wait() does not hang
                self._value.set_exception(e)
                raise

    def _run(self) -> None:
        try:
            self._value.set_result(self._build())
        except BaseException as e:  # raised on the caller's thread by result()
            self._value.set_exception(e)

    def result(self) -> T:
        """The value, once built (build's own error if it failed); started now if it was not."""
        self.start()
        return self._value.result()

    def done(self) -> bool:
        return self._value.done()

    def wait(self) -> None:
        """Return once build() has ended, either way, or at once if it never started."""
        if self._started.locked():
            self._value.exception()

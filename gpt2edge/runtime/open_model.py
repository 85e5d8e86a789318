"""The one factory that opens a folder's graph: the kind its manifest names (a static export, a sparse or an
approximate head, or the plain dynamic graph). It sits above runtime/model and runtime/sparse_head, so the model
room imports nothing from the sparse head's; every caller gets a runtime/model/contract.py Graph."""

from __future__ import annotations

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

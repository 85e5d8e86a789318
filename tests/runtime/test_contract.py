"""The model contract in code (gpt2edge/runtime/model/contract.py): every graph kind the factory opens is a Graph,
every generation context on it an LM, both kinds of cache rows the server runs are Rows, member by member; and the
capability members say what each kind cannot do (the callers read them instead of probing the kind)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gpt2edge.errors import GenerationError
from gpt2edge.export.static import StaticShape
from gpt2edge.runtime.decoding.solo_rows import SoloRows
from gpt2edge.runtime.model.contract import LM, Graph, Rows
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.slots import SlotLM
from gpt2edge.runtime.open_model import load_graph

TEXT = "def read(path):\n    with open(path) as f:\n        return f.read()\n" * 6
# folder kind -> (the graph kind, the LM kind) the factory gives
KINDS = {
    "dynamic": ("OrtGraph", "OrtLM"),
    "shared": ("OrtGraph", "OrtLM"),
    "static": ("StaticGraph", "StaticLM"),
    "sparse": ("SparseGraph", "SparseLM"),
    "approx": ("ApproxGraph", "ApproxLM"),
}


def members(protocol: type) -> list[str]:
    """A Protocol's members: its annotated attributes, properties and methods (not the dunder machinery)."""
    own = [n for n in vars(protocol) if not n.startswith("_")]
    return sorted({*protocol.__annotations__, *own})


def missing(obj: object, protocol: type) -> list[str]:
    return [m for m in members(protocol) if not hasattr(obj, m)]


@pytest.fixture(scope="module")
def folders(tiny_checkpoint, tiny_export, tiny_export_shared, tmp_path_factory) -> dict[str, Path]:
    from gpt2edge.export import export_model
    from gpt2edge.sparse.approx_handler import cluster_sparse_head
    from gpt2edge.sparse.handler import sparse_head

    root = tmp_path_factory.mktemp("contract")
    export_model(str(tiny_checkpoint), root / "static", static=StaticShape(batch=2, chunk=8, capacity=32),
                 run_validation=False, log=None)  # fmt: skip
    sparse_head(tiny_export, root / "sparse", rank=4, candidates_k=32)
    cluster_sparse_head(tiny_export, root / "approx", clusters=16, probe=2, text=TEXT, report_tokens=32, log=None)
    return {
        "dynamic": tiny_export,
        "shared": tiny_export_shared,
        **{k: root / k for k in ("static", "sparse", "approx")},
    }


@pytest.fixture(scope="module")
def graphs(folders) -> dict:
    return {kind: load_graph(ModelFolder.open(path)) for kind, path in folders.items()}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_is_a_graph_and_its_context_an_lm(graphs, kind):
    graph = graphs[kind]
    lm = graph.new_lm()
    assert (type(graph).__name__, type(lm).__name__) == KINDS[kind]
    assert missing(graph, Graph) == [] and isinstance(graph, Graph)
    assert missing(lm, LM) == [] and isinstance(lm, LM)
    assert lm.graph is graph and lm.n_positions == graph.n_positions and lm.vocab_size == graph.vocab_size


def test_a_kind_missing_one_member_fails_the_check(graphs):
    """The check above could pass by seeing nothing: an object with every LM member but one is not an LM."""
    lm = graphs["dynamic"].new_lm()
    full = SimpleNamespace(**{m: getattr(lm, m) for m in members(LM)})
    assert isinstance(full, LM)
    for gone in ("configure_head", "batch", "supports_row_state", "past_len"):
        partial = SimpleNamespace(**{m: getattr(lm, m) for m in members(LM) if m != gone})
        assert not isinstance(partial, LM) and missing(partial, LM) == [gone]


@pytest.mark.parametrize("kind", ["dynamic", "shared", "sparse"])
def test_cache_rows_are_rows(graphs, kind):
    for rows in (SlotLM(graphs[kind], 2), SoloRows(graphs[kind], 2)):
        assert missing(rows, Rows) == [] and isinstance(rows, Rows)


def test_capabilities_are_said_by_members(graphs):
    dyn, static, sparse, approx = (graphs[k] for k in ("dynamic", "static", "sparse", "approx"))
    # cache rows that join and leave: dynamic and sparse graphs on the CPU; the others say why not
    assert dyn.slot_refusal is None and sparse.slot_refusal is None
    assert "--static" in static.slot_refusal and "approximate" in approx.slot_refusal
    for graph in (static, approx):
        with pytest.raises(GenerationError, match="cannot run this folder"):
            SlotLM(graph, 2)
    # the static batch, the approximate head, the prefix cache and a saved row state
    assert static.batch == static.new_lm().batch == 2 and dyn.batch is None and dyn.new_lm().batch is None
    assert approx.approximate["approximate"] is True and all(g.approximate is None for g in (dyn, static, sparse))
    assert [g.supports_prefix_cache for g in (dyn, static, sparse, approx)] == [True, False, False, False]
    assert [g.new_lm().supports_row_state for g in (dyn, static, sparse, approx)] == [True, False, False, False]
    assert dyn.probe_refusal is None and sparse.probe_refusal is not None


def test_a_static_context_refuses_the_row_methods_in_one_line(graphs):
    lm = graphs["static"].new_lm()
    lm.start(1, 8)
    for call in (lambda: lm.use_rows(1), lambda: lm.expand_rows(2), lambda: lm.reorder_rows(np.zeros(1, int)),
                 lambda: lm.rewind(0), lambda: lm.compact(np.zeros(0, int)), lm.row_tensors):  # fmt: skip
        with pytest.raises(GenerationError, match="fixed batch and cache shapes") as e:
            call()
        assert "\n" not in str(e.value)


def test_the_head_switch_is_every_kinds(graphs):
    """configure_head is called on every LM by the generate loop: None from the exact kinds, the approximate
    head's description from its own (and its refusal of recorded log-probs)."""
    from gpt2edge.runtime.decoding.sampling import SamplingParams

    for kind in ("dynamic", "static", "sparse"):
        lm = graphs[kind].new_lm()
        lm.start(1, 8)
        assert lm.configure_head(SamplingParams(), False) is None
    lm = graphs["approx"].new_lm()
    lm.start(1, 8)
    assert lm.configure_head(SamplingParams(), False) == graphs["approx"].approximate
    with pytest.raises(GenerationError, match="logprobs"):
        lm.configure_head(SamplingParams(), True)

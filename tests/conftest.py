"""Session-wide fixtures: each tiny model is built and exported once and shared (an export takes seconds)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

# A suite started in the background by a non-interactive shell (`cmd &`, nohup) inherits SIGINT (and SIGHUP)
# ignored, and so would every command the tests start: the Ctrl-C / hang-up tests would then see a program
# that cannot be interrupted. Give the children the dispositions a terminal gives them.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

# ModelFolder.open records a passed full check under the user's cache directory (gpt2edge.manifest.verified):
# the suite's records go to a directory of its own, removed at exit, never into the user's ~/.cache
os.environ["GPT2EDGE_CACHE_DIR"] = _cache = tempfile.mkdtemp(prefix="gpt2edge-test-cache-")
atexit.register(shutil.rmtree, _cache, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from gpt2edge.export import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(tiny_checkpoint, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def tiny_export(tiny_checkpoint, tmp_path_factory) -> Path:
    from gpt2edge.export import export_model

    out = tmp_path_factory.mktemp("exp") / "tiny"
    export_model(str(tiny_checkpoint), out)
    return out


@pytest.fixture(scope="session")
def tiny_export_all(tiny_checkpoint, tmp_path_factory) -> Path:
    from gpt2edge.export import export_model

    out = tmp_path_factory.mktemp("exp") / "tiny-all"
    export_model(str(tiny_checkpoint), out, head="all")
    return out


@pytest.fixture(scope="session")
def tiny_export_shared(tiny_checkpoint, tmp_path_factory) -> Path:
    from gpt2edge.export import export_model

    out = tmp_path_factory.mktemp("exp") / "tiny-shared"
    export_model(str(tiny_checkpoint), out, kv_cache="shared")
    return out


def peaked_checkpoint(src, out):
    """The tiny random checkpoint with a low-rank, scaled tied table: peaked next-token distributions."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(src).eval()
    V, C = model.transformer.wte.weight.shape
    g = torch.Generator().manual_seed(1)
    table = torch.randn(V, 3, generator=g) @ torch.randn(3, C, generator=g) * 1.5 + 0.02 * torch.randn(
        V, C, generator=g
    )
    with torch.no_grad():
        model.transformer.wte.weight.copy_(table)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    GenerationConfig.from_pretrained(src).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def sparse_grid(tiny_checkpoint, tmp_path_factory) -> dict:
    """(kv cache, precision) -> (parent folder, sparse folder) of sparse-head tests (tests/runtime/test_sparse_*.py):
    both cache kinds at fp32 / int8 / int4, on a peaked model (random tables give flat logits nothing certifies)."""
    from gpt2edge.export import export_model
    from gpt2edge.quantize.handler import make_recipe, quantize_model
    from gpt2edge.sparse.handler import sparse_head

    root = tmp_path_factory.mktemp("sparse")
    ckpt = peaked_checkpoint(tiny_checkpoint, root / "ckpt")
    out = {}
    for kv in ("concat", "shared"):
        fp32 = root / f"{kv}-fp32"
        export_model(str(ckpt), fp32, kv_cache=kv, run_validation=False, log=None)
        for p in ("fp32", "int8", "int4"):
            parent = fp32 if p == "fp32" else root / f"{kv}-{p}"
            if p != "fp32":
                quantize_model(fp32, parent, make_recipe(p), report=False)
            sparse_head(parent, root / f"{kv}-{p}-sparse", rank=4, candidates_k=32)
            out[kv, p] = parent, root / f"{kv}-{p}-sparse"
    return out

"""The certified sparse head (`gpt2edge sparse-head`): greedy ids and top-k distributions identical to the full
head's, on both KV cache kinds at fp32 / int8 / int4, and every path that needs the full head exact too.

Random tables give flat logits that no bound certifies, so the model here has a low-rank tied table (a few
directions plus a little noise, scaled up): peaked distributions and tight bounds, so most steps certify and the
sparse path is what is tested. A grid of folders is built once per module.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.runtime.decoding.sampling import SamplingParams, softmax
from gpt2edge.runtime.generator import Generator

PROMPTS = ["The river rose and", "A quiet"]
KINDS = [(kv, p) for kv in ("concat", "shared") for p in ("fp32", "int8", "int4")]


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


@pytest.fixture(scope="module")
def grid(tiny_checkpoint, tmp_path_factory) -> dict:
    """(kv cache, precision) -> (parent folder, sparse folder)."""
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
            sparse_head(parent, root / f"{kv}-{p}-sparse", rank=4)
            out[kv, p] = parent, root / f"{kv}-{p}-sparse"
    return out


@pytest.fixture(scope="module")
def gens(grid) -> dict:
    return {key: (Generator(a), Generator(b)) for key, (a, b) in grid.items()}


@pytest.mark.parametrize("key", KINDS, ids=["-".join(k) for k in KINDS])
def test_greedy_ids_identical(gens, key):
    full, sparse = gens[key]
    assert sparse.graph.certify
    sparse.graph.reset_stats()
    a = full.generate(PROMPTS, max_new_tokens=40, ignore_eos=True)
    b = sparse.generate(PROMPTS, max_new_tokens=40, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    st = sparse.graph.stats
    assert st.full == 0 and st.steps == 2 * 40
    assert st.certified >= 0.8 * st.steps  # the sparse path did the work
    assert st.rows_read < st.certified * sparse.graph.vocab_size  # and read fewer rows than the full head


@pytest.mark.parametrize("key", KINDS, ids=["-".join(k) for k in KINDS])
def test_top_k_distribution_identical(gens, key):
    """The sparse row's top-k set and softmax equal the full head's log-probs' (within float rounding), and
    seeded top-k sampling draws the same tokens."""
    full, sparse = gens[key]
    params = SamplingParams(do_sample=True, top_k=5, temperature=0.7)
    ids = np.array([full.tokenizer.encode(PROMPTS[0])])
    mask, pos = np.ones_like(ids), np.arange(ids.shape[1])[None]
    lm_a, lm_b = full.graph.new_lm(), sparse.graph.new_lm()
    lm_a.start(1, ids.shape[1])
    lm_b.start(1, ids.shape[1])
    lm_b.configure_head(params)
    sparse.graph.reset_stats()
    lp = lm_a.forward(ids, mask, pos)[0]
    row = lm_b.forward(ids, mask, pos)[0]
    assert sparse.graph.stats.certified == 1
    top_a, top_b = np.sort(np.argsort(lp)[-5:]), np.sort(np.argsort(row)[-5:])
    assert np.array_equal(top_a, top_b)
    assert np.isneginf(row).sum() > 0  # rows not read stay -inf
    np.testing.assert_allclose(softmax(row[top_b] / 0.7), softmax(lp[top_a] / 0.7), atol=1e-5)
    kw = dict(max_new_tokens=30, ignore_eos=True, do_sample=True, top_k=5, temperature=0.7, seed=3)
    assert full.generate(PROMPTS[1], **kw).token_ids == sparse.generate(PROMPTS[1], **kw).token_ids


def test_full_head_calls_are_the_parents(gens):
    """Log-probs, top-p, beam search: the full head (the parent's head graph) every step, results as the parent's."""
    full, sparse = gens["shared", "int8"]
    sparse.graph.reset_stats()
    a = full.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True, logprobs=2)
    b = sparse.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True, logprobs=2)
    assert a.token_ids == b.token_ids
    assert [(t.logprob, [x.logprob for x in t.top_logprobs]) for t in a.logprobs] == [
        (t.logprob, [x.logprob for x in t.top_logprobs]) for t in b.logprobs
    ]
    kw = dict(max_new_tokens=12, ignore_eos=True, do_sample=True, top_p=0.9, seed=5)
    assert full.generate(PROMPTS[0], **kw).token_ids == sparse.generate(PROMPTS[0], **kw).token_ids
    beams = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2)
    ra, rb = full.generate(PROMPTS[0], **beams), sparse.generate(PROMPTS[0], **beams)
    assert [r.token_ids for r in ra] == [r.token_ids for r in rb]
    assert [r.sequence_score for r in ra] == [r.sequence_score for r in rb]
    st = sparse.graph.stats
    assert st.certified == 0 and st.full == st.steps > 0


def test_uncertified_steps_fall_back_and_are_counted(gens):
    """A step whose candidates exceed the cap runs the full head: still the parent's tokens, counted."""
    full, sparse = gens["concat", "int4"]
    cap = sparse.graph.max_rows
    sparse.graph.max_rows = 0  # no step may read a row: every step falls back
    try:
        sparse.graph.reset_stats()
        a = full.generate(PROMPTS[1], max_new_tokens=10, ignore_eos=True)
        b = sparse.generate(PROMPTS[1], max_new_tokens=10, ignore_eos=True)
    finally:
        sparse.graph.max_rows = cap
    assert a.token_ids == b.token_ids
    assert sparse.graph.stats.fallbacks == 10 and sparse.graph.stats.certified == 0


def test_stream_and_session_identical(gens):
    full, sparse = gens["shared", "fp32"]
    kw = dict(max_new_tokens=15, ignore_eos=True)
    assert "".join(sparse.stream(PROMPTS[0], **kw)) == full.generate(PROMPTS[0], **kw).text
    sa, sb = full.session(), sparse.session()
    for turn in PROMPTS:
        assert sa.generate(turn, **kw).token_ids == sb.generate(turn, **kw).token_ids


def test_speculative_and_direct_graph_refused(grid):
    from gpt2edge.runtime.model.folder import ModelFolder
    from gpt2edge.runtime.model.lm import OrtGraph

    _, sp = grid["concat", "fp32"]
    with pytest.raises((ModelFolderError, GenerationError), match="last position only"):
        Generator(sp, prompt_lookup=2)
    with pytest.raises(ModelFolderError, match="sparse head"):
        OrtGraph(ModelFolder.open(sp))

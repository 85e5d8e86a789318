"""Memory is bounded before work starts, on every input: a request whose estimate does not fit in the available
memory is refused with one line naming the estimate (in the library, so the Python API is protected too).
Cheap: available memory is capped with GPT2EDGE_MAX_MEMORY (or monkeypatched), nothing big is allocated."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpt2edge import memory
from gpt2edge.cli import main
from gpt2edge.errors import GenerationError
from gpt2edge.runtime import Generator


@pytest.fixture(scope="module")
def gen(tiny_export) -> Generator:
    return Generator(tiny_export)


@pytest.fixture
def cap(monkeypatch):
    def set_cap(size: str) -> None:
        monkeypatch.setenv(memory.ENV, size)

    return set_cap


# (kwargs of generate, prompts): each grows one dimension of what a generation holds
HUGE = [
    ({"num_beams": 50_000, "max_new_tokens": 2}, ["hi"]),
    ({"num_return_sequences": 100_000, "do_sample": True, "max_new_tokens": 2}, ["hi"]),
    ({"num_return_sequences": 2**62, "do_sample": True, "max_new_tokens": 2}, ["hi"]),
    ({"num_beams": 2**40, "num_return_sequences": 2, "max_new_tokens": 2}, ["hi"]),
    ({"logprobs": 399, "max_new_tokens": 100, "ignore_eos": True}, ["hi"] * 64),
    ({"max_new_tokens": 2}, ["hi"] * 10_000),
]


@pytest.mark.parametrize(("kwargs", "prompts"), HUGE, ids=lambda v: str(v)[:40])
def test_a_generation_over_the_memory_is_refused_before_work(gen, cap, kwargs, prompts):
    cap("64M")
    lm_before = gen._pool.primary.cache.allocations
    with pytest.raises(GenerationError, match=r"would hold about .* of memory \(.*\), more than the 67.1 MB"):
        gen.generate(prompts, **kwargs)
    assert gen._pool.primary.cache.allocations == lm_before  # no KV cache was reserved


def test_what_fits_still_runs(gen, cap):
    cap("64M")
    out = gen.generate("hi", num_beams=4, num_return_sequences=2, max_new_tokens=3)
    assert len(out) == 2
    out = gen.generate(["hi", "there"], max_new_tokens=3, logprobs=5)
    assert len(out[0].logprobs) == 3


def test_the_estimate_scales_with_every_dimension(gen):
    from gpt2edge.runtime.memory_plan import generation_estimate

    base = generation_estimate(gen.folder, [[1, 2, 3]], 10).total
    assert generation_estimate(gen.folder, [[1, 2, 3]] * 4, 10).total > 3 * base
    assert generation_estimate(gen.folder, [[1, 2, 3]], 10, num_beams=4).total > 3 * base
    assert generation_estimate(gen.folder, [[1, 2, 3]], 10, num_return_sequences=4).total > 3 * base
    assert generation_estimate(gen.folder, [[1, 2, 3]], 100).total > generation_estimate(gen.folder, [[1]], 10).total
    assert generation_estimate(gen.folder, [[1, 2, 3]], 10, logprobs=100).total > 10 * base


def test_stream_is_bounded_too(gen, cap):
    cap("1M")
    with pytest.raises(GenerationError, match="would hold about"):
        next(gen.stream("hi", max_new_tokens=100, logprobs=399, ignore_eos=True))


@pytest.mark.parametrize(
    "args",
    [
        ["--num-beams", "50000", "-n", "2"],
        ["--num-return-sequences", "100000", "--do-sample", "-n", "2"],
        ["--num-return-sequences", str(2**62), "--do-sample", "-n", "2"],
        ["--logprobs", "399", "-n", "100", "--json"],
    ],
)
def test_cli_prints_one_error_line_naming_the_estimate(tiny_export, args):
    r = CliRunner().invoke(main, ["generate", str(tiny_export), "-p", "hi", *args], env={memory.ENV: "32M"})
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: This generation would hold about"), r.stderr
    assert "KV cache" in lines[0] or "log-probs" in lines[0]


def test_available_memory_is_the_smallest_known_limit(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 8 << 30)
    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: 3 << 30)
    monkeypatch.setattr(memory, "_address_space_left", lambda: None)
    monkeypatch.delenv(memory.ENV, raising=False)
    assert memory.available_bytes() == 3 << 30
    monkeypatch.setenv(memory.ENV, "1.5G")
    assert memory.available_bytes() == int(1.5 * (1 << 30))
    monkeypatch.setenv(memory.ENV, "lots")
    with pytest.raises(memory.Gpt2EdgeError, match="is not a size"):
        memory.available_bytes()

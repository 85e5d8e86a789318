"""Runtime: generation parity with transformers, IO-bound cache reuse, streaming, errors, no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from gpt2edge.errors import DeviceError, GenerationError, ModelFolderError
from gpt2edge.runtime import Generator, SamplingParams, available_devices
from gpt2edge.runtime.decoding.generate import generate, length_error
from gpt2edge.runtime.model.tokenizer import StreamDecoder, TextTokenizer


@pytest.fixture(scope="module")
def gen(tiny_export) -> Generator:
    return Generator(tiny_export)


def hf_greedy(hf_model, prompts: list[list[int]], n: int, pad_id: int) -> list[list[int]]:
    """transformers generate(do_sample=False) on a left-padded batch; EOS suppressed for n tokens."""
    S = max(map(len, prompts))
    ids = torch.full((len(prompts), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), S), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, S - len(p) :] = torch.tensor(p)
        mask[b, S - len(p) :] = 1
    out = hf_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id
    )
    return out[:, S:].tolist()


def test_greedy_equals_transformers_batch_1(gen, hf_model):
    r = gen.generate("The river rose and", max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert len(r.token_ids) == 32
    assert r.token_ids == hf_greedy(hf_model, [r.prompt_token_ids], 32, gen.pad_token_id)[0]


def test_greedy_equals_transformers_left_padded_batch(gen, hf_model):
    rs = gen.generate(
        ["Children learned to swim before they could read", "The city"],
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
    )
    assert len(rs[0].prompt_token_ids) != len(rs[1].prompt_token_ids)
    ref = hf_greedy(hf_model, [r.prompt_token_ids for r in rs], 32, gen.pad_token_id)
    assert [r.token_ids for r in rs] == ref


def test_io_binding_on_and_off_give_identical_tokens(tiny_export, gen):
    plain = Generator(tiny_export, io_binding=False)
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    prompts = ["The weather is mild", "Visitors walk"]
    assert [r.token_ids for r in gen.generate(prompts, **kw)] == [r.token_ids for r in plain.generate(prompts, **kw)]


def written_pointers(lm) -> list[int]:
    """Where ONNX Runtime wrote the last step's presents: the IO binding's outputs after the log-probs."""
    return [o.data_ptr() for o in lm.binding.get_outputs()[1:]]


def test_cache_buffers_are_allocated_once_and_reused(tiny_export):
    g = Generator(tiny_export)
    lm = g.lm
    seen_pointers: list[list[int]] = []
    g.generate(
        "The river", max_new_tokens=20, ignore_eos=True, callback=lambda s: seen_pointers.append(written_pointers(lm))
    )
    assert lm.cache.allocations == 1
    allowed = {lm.cache.pointer(slot, t) for slot in (0, 1) for t in range(lm.cache.n_tensors)}
    # ORT wrote every step's presents into our two buffers per tensor (no cache allocation of its own)
    assert len(seen_pointers) == 20
    assert all(set(step) <= allowed for step in seen_pointers)
    assert len({tuple(step) for step in seen_pointers}) == 2  # ping-pong between two slots
    g.generate("The river", max_new_tokens=20, ignore_eos=True)  # same size: the buffers are reused
    assert lm.cache.allocations == 1


def test_same_seed_same_text(gen):
    kw = dict(max_new_tokens=16, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    assert gen.generate("The river", **kw).token_ids == gen.generate("The river", **kw).token_ids


def test_each_row_stops_on_its_own(tiny_export):
    g = Generator(tiny_export)
    prompts = ["The river", "Students arrive"]
    row0, row1 = (r.token_ids for r in g.generate(prompts, max_new_tokens=12, do_sample=False, ignore_eos=True))
    # the end-of-text token becomes one that row 0 generates before its last step and row 1 never does
    eos = next((t for t in row0[:-1] if t not in row1), None)
    assert eos is not None, "the probe prompts need a token only row 0 generates"
    g.eos_token_id = (eos,)
    rows = g.generate(prompts, max_new_tokens=12, do_sample=False)
    assert rows[0].finish_reason == "eos" and rows[0].token_ids == row0[: row0.index(eos) + 1]
    assert rows[1].finish_reason == "length" and rows[1].token_ids == row1


def test_stop_string_cuts_text_and_stream_agrees(gen):
    base = gen.generate("The city", max_new_tokens=24, do_sample=False, ignore_eos=True)
    stop = base.text[6:9]
    assert stop and stop in base.text
    r = gen.generate("The city", max_new_tokens=24, do_sample=False, ignore_eos=True, stop=[stop])
    assert r.finish_reason == "stop" and r.text == base.text[: base.text.find(stop)]
    streamed = "".join(gen.stream("The city", max_new_tokens=24, do_sample=False, ignore_eos=True, stop=[stop]))
    assert streamed == r.text


def test_stream_equals_final_text_and_never_splits_a_character(gen):
    result: list = []
    pieces = list(gen.stream("The river", max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True, result=result))
    assert "".join(pieces) == result[0].text
    assert len(result[0].token_ids) == 40


@pytest.mark.parametrize("text", ["今天天气不错", "hello 👋🏽 world 🌍!", "naïve café"])
def test_stream_decoder_multibyte(tiny_export, text):
    tok = TextTokenizer(tiny_export / "tokenizer.json")
    ids = tok.encode(text)
    assert len(ids) > len(text.encode()) // 4  # the tiny vocab splits these characters across tokens
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_nan_logprobs_stop_with_clear_error(tiny_export, monkeypatch):
    g = Generator(tiny_export)
    real = g.lm.forward

    def poisoned(*a):
        out = real(*a)
        return np.full_like(out, np.nan) if g.lm.past_len > 4 else out

    monkeypatch.setattr(g.lm, "forward", poisoned)
    with pytest.raises(GenerationError, match="NaN log-probabilities"):
        g.generate("The river", max_new_tokens=10, ignore_eos=True)


def test_interrupt_keeps_what_was_generated(gen):
    def ctrl_c(step):
        if step.index == 3:
            raise KeyboardInterrupt

    r = gen.generate("The river", max_new_tokens=20, ignore_eos=True, callback=ctrl_c)
    assert r.finish_reason == "interrupted" and len(r.token_ids) == 4


def test_prompt_too_long_errors_or_truncates(gen):
    long_prompt = "The river rose. " * 60
    with pytest.raises(GenerationError, match=f"--truncate to keep its last {gen.lm.n_positions - 8} tokens"):
        gen.generate(long_prompt, max_new_tokens=8)
    r = gen.generate(long_prompt, max_new_tokens=8, truncate=True, ignore_eos=True)
    assert len(r.prompt_token_ids) + 8 == gen.lm.n_positions
    assert r.prompt_token_ids == gen.tokenizer.encode(long_prompt)[-len(r.prompt_token_ids) :]


@pytest.mark.parametrize("extra", [72, 0])  # max_new_tokens = n_positions + extra: 200 and 128 on the tiny model
def test_max_new_tokens_filling_the_model_says_lower_it_not_truncate(gen, extra):
    n, N = gen.lm.n_positions + extra, gen.lm.n_positions
    P = len(gen.tokenizer.encode("The river"))
    for truncate in (False, True):  # truncating the prompt cannot make room: the verdict is the same
        with pytest.raises(GenerationError) as e:
            gen.generate("The river", max_new_tokens=n, truncate=truncate)
        msg = str(e.value)
        assert f"lower --max-new-tokens to at most {N - P}" in msg and "cannot help" in msg
        assert "pass --truncate" not in msg and "\n" not in msg
    # the loop's own check (bench, quality) says the same
    with pytest.raises(GenerationError, match=f"at most {N - 3}"):
        generate(gen.lm, gen.tokenizer, [[1, 2, 3]], SamplingParams(max_new_tokens=n), pad_id=0)


def test_length_error_names_a_fix_that_works():
    N = 128
    for P in (1, 5, 127, 128, 300):
        for n in (1, 8, 127, 128, 200):
            msg = length_error(P, n, N)
            assert (msg is None) == (P + n <= N)
            if msg is None:
                continue
            if n >= N:  # no prompt fits: only a lower max_new_tokens helps
                assert "--truncate" not in msg and ("at most" in msg) == (P < N)
            else:  # the prompt is the problem: truncation keeps N - n tokens, which is >= 1
                assert f"--truncate to keep its last {N - n} tokens" in msg
            if P < N:
                assert f"at most {N - P}" in msg


@pytest.mark.parametrize("threads", [0, -3, 100_000, 2.5, True])
def test_threads_out_of_range_is_refused_before_any_thread_starts(tiny_export, threads):
    with pytest.raises(DeviceError, match=r"^--threads must be an integer from 1 to \d+ .*got"):
        Generator(tiny_export, threads=threads)


def test_plain_stop_string_is_one_stop_string(gen):
    assert gen.sampling_params(stop="abc").stop == ("abc",)
    assert gen.sampling_params(stop=["abc", "d"]).stop == ("abc", "d")
    base = gen.generate("The city", max_new_tokens=24, do_sample=False, ignore_eos=True)
    # a stop string whose first character appears in the text before the stop string itself does
    text = base.text
    i = next(i for i in range(1, len(text) - 3) if text.find(text[i : i + 3]) == i and text[i] in text[:i])
    stop = text[i : i + 3]
    r = gen.generate("The city", max_new_tokens=24, do_sample=False, ignore_eos=True, stop=stop)
    assert r.finish_reason == "stop" and r.text == base.text[: base.text.find(stop)]
    assert "".join(gen.stream("The city", max_new_tokens=24, do_sample=False, ignore_eos=True, stop=stop)) == r.text
    with pytest.raises(TypeError, match="each of stop must be a str, got int 1"):  # ArgumentTypeError
        gen.sampling_params(stop=[1])
    with pytest.raises(GenerationError, match="Stop strings must be non-empty strings"):
        gen.sampling_params(stop=[""])


def test_generation_config_defaults_are_used(tiny_export, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_export, folder)
    cfg = json.loads((folder / "generation_config.json").read_text())
    cfg.update(max_new_tokens=5)
    (folder / "generation_config.json").write_text(json.dumps(cfg))
    g = Generator(folder, verify=False)
    assert len(g.generate("The", ignore_eos=True).token_ids) == 5
    assert g.sampling_params(temperature=0.5).do_sample  # a sampling knob turns sampling on
    assert not g.sampling_params(temperature=0.5, do_sample=False).do_sample


def test_bad_folders(tiny_export, tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        Generator(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFolderError, match="not a gpt2edge export"):
        Generator(tmp_path / "empty")
    tampered = tmp_path / "tampered"
    shutil.copytree(tiny_export, tampered)
    with open(tampered / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(ModelFolderError, match="does not match its manifest checksum"):
        Generator(tampered)
    Generator(tampered, verify=False)  # --no-verify skips the check
    (tampered / "model.onnx").unlink()
    with pytest.raises(ModelFolderError, match="missing"):
        Generator(tampered)


def test_cuda_request_without_provider_is_clear(tiny_export):
    if "cuda" in available_devices():
        pytest.skip("CUDA provider present")
    with pytest.raises(DeviceError, match="no CUDAExecutionProvider"):
        Generator(tiny_export, device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in available_devices(), reason="CUDA execution provider not available")
def test_cuda_greedy_matches_cpu(tiny_export, gen):
    cuda = Generator(tiny_export, device="cuda")
    kw = dict(max_new_tokens=24, do_sample=False, ignore_eos=True)
    prompts = ["The river rose and", "Visitors"]
    assert [r.token_ids for r in cuda.generate(prompts, **kw)] == [r.token_ids for r in gen.generate(prompts, **kw)]
    assert cuda.lm.cache.allocations == 1


BLOCKED = ("torch", "transformers", "onnx", "onnxscript")  # what the runtime must never import
BLOCKER = textwrap.dedent(
    f"""
    import sys, importlib.abc
    attempts = []
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in {BLOCKED!r}:
                attempts.append(name)  # recorded even if the importer catches the ImportError
                raise ImportError(f'{{name}} is blocked: the runtime must not need it')
    sys.meta_path.insert(0, Block())
    """
)


def run_cli(*args, block_torch: bool = False):
    """Run the CLI in a fresh interpreter; with block_torch, importing any of BLOCKED fails there and every
    attempt is reported on the last stderr line as `blocked imports: [...]`."""
    report = "print('blocked imports:', sorted(set(attempts)), file=sys.stderr)" if block_torch else "pass"
    code = (BLOCKER if block_torch else "") + textwrap.dedent(
        f"""
        import sys
        from gpt2edge.cli import main
        try:
            main(sys.argv[1:])  # standalone, as the console script runs it: click's own errors exit 2
        finally:
            {report}
        """
    )
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120)


def test_import_blocker_catches_an_import_that_is_caught():
    """The blocker itself can fail: an optional `try: import onnx` is still reported."""
    code = BLOCKER + "try:\n    import onnx\nexcept ImportError:\n    pass\nprint(attempts)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "['onnx']", p.stderr


def test_generate_cli_without_torch_prints_pure_json(tiny_export):
    p = run_cli("generate", tiny_export, "-p", "The river", "-n", "6", "--json", "--ignore-eos", block_torch=True)
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip().splitlines()[-1] == "blocked imports: []"
    out = json.loads(p.stdout)  # stdout is exactly one JSON object
    timings = ("prefill_ms", "decode_ms_per_token_mean", "decode_ms_per_token_median", "sampler_ms_per_token_mean")
    for key in ("text", "token_ids", "prompt_token_ids", "finish_reason", *timings, "wall_ms", "tokens_per_s"):
        assert key in out
    assert out["tokens_per_s"] == pytest.approx(6 / (out["wall_ms"] / 1e3))
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"


def test_generate_cli_streams_and_reports_errors(tiny_export):
    p = run_cli("generate", tiny_export, "-p", "The river", "-n", "5", "--seed", "1", "--temperature", "0.7")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("The river") and "ms/token" in p.stderr
    bad = run_cli("generate", tiny_export, "-p", "x", "--num-return-sequences", "2")  # greedy gives one sequence
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().startswith("error: num_return_sequences=2 needs sampling") and bad.stderr.count("\n") == 1
    # out-of-range numbers are click's (exit 2); the library bound is tested on its own
    penalty = run_cli("generate", tiny_export, "-p", "x", "--repetition-penalty", "0")
    assert penalty.returncode == 2 and "Invalid value for '--repetition-penalty'" in penalty.stderr
    # click's range catches it before any thread starts (the library bound is tested on its own)
    threads = run_cli("generate", tiny_export, "-p", "x", "--threads", "100000")
    assert threads.returncode == 2 and threads.stdout == ""
    assert "Invalid value for '-t' / '--threads'" in threads.stderr and "Traceback" not in threads.stderr

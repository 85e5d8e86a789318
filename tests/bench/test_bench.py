"""`gpt2edge bench`: every field present and plausible, the sweep and its plot, defaults that fit the model,
the bandwidth floor only where it applies, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import gpt2edge.bench.bench as bench_module
import gpt2edge.bench.probe as probe_module
from gpt2edge.cli import main
from gpt2edge.errors import GenerationError
from gpt2edge.manifest import load_manifest

REPO = Path(__file__).resolve().parents[2]

FIELDS = (
    "prefill_ms",
    "decode_ms_per_token",
    "decode_ms_per_token_median",
    "decode_ms_per_token_mean",
    "decode_ms_p90",
    "tokens_per_s",
    "sampler_ms_per_token",
    "peak_rss_mb",
    "model_bytes",
    "bytes_read_per_step",
    "achieved_bandwidth_gbs",
    "machine_read_bandwidth_gbs",
    "machine_matmul_gflops",
    "decode_floor_ms",
    "decode_vs_floor",
    "prefill_floor_ms",
    "prefill_ms_best",
    "decode_ms_best_run",
    "decode_vs_floor_best_run",
)


def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


@pytest.fixture
def llc(monkeypatch):
    """Set the last-level cache size bench sees (None: unknown, so the bandwidth floor is assumed to apply)."""

    def set_llc(nbytes):
        monkeypatch.setattr(bench_module, "last_level_cache_bytes", lambda: nbytes)

    return set_llc


def test_bench_json_fields_are_plausible(tiny_export, llc):
    llc(None)
    r = bench(tiny_export, "--prompt-len", "16", "--new-tokens", "8", "--repeat", "2", "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)  # stdout is pure JSON
    for f in FIELDS:
        assert rec[f] > 0, f
    assert rec["decode_ms_p90"] >= rec["decode_ms_per_token"]
    # decode_ms_per_token is the median (generate's is the mean): both are named explicitly
    assert rec["decode_ms_per_token_median"] == rec["decode_ms_per_token"]
    assert rec["decode_vs_floor"] == pytest.approx(rec["decode_ms_per_token_median"] / rec["decode_floor_ms"])
    assert rec["decode_floor_note"] is None and rec["last_level_cache_bytes"] is None
    # the best run is one of the runs: no slower than the slowest, and its prefill no slower than the median
    assert rec["prefill_ms_best"] <= rec["prefill_ms"]
    assert rec["decode_ms_best_run"] <= rec["decode_ms_p90"]
    assert rec["decode_vs_floor_best_run"] == pytest.approx(rec["decode_ms_best_run"] / rec["decode_floor_ms"])
    manifest = dict(load_manifest(tiny_export).raw)
    assert rec["model_bytes"] == manifest["files"]["model.onnx"]["size"]
    assert rec["bytes_read_per_step"] > manifest["graph"]["decode_weight_bytes"]  # weights + KV cache
    assert rec["config"]["repeat"] == 2 and rec["precision"] == "fp32"
    for probe in ("machine_read_bandwidth", "machine_matmul_gflops"):  # probed before and after the runs
        value = rec[probe + ("_gbs" if "bandwidth" in probe else "")]
        lo, hi = rec[probe + ("_range_gbs" if "bandwidth" in probe else "_range")]
        assert 0 < lo <= hi == value  # the floors use the better probe


def test_shared_graph_reads_the_cache_once(tiny_export, tiny_export_shared):
    """The byte count of a decode step: weights + KV cache twice (concat: Concat and attention) or once
    (shared: the fused attention reads the valid slots in place)."""
    args = ("--prompt-len", "16", "--new-tokens", "8", "--repeat", "1", "--json")
    concat, shared = (json.loads(bench(folder, *args).stdout) for folder in (tiny_export, tiny_export_shared))
    assert shared["kv_cache"] == "shared" and concat["kv_cache"] == "concat"
    kv = {r["kv_cache"]: r["bytes_read_per_step"] - r["weight_bytes_per_step"] for r in (concat, shared)}
    assert kv["concat"] == pytest.approx(2 * kv["shared"])


def test_sweep_and_plot(tiny_export, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    r = bench(
        tiny_export, "--prompt-len", "8", "--new-tokens", "4", "--repeat", "1", "--sweep", "--plot", png, "--json"
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    contexts = [row["context"] for row in rec["sweep"]]
    assert contexts[0] == 32 and contexts[-1] == load_manifest(tiny_export).raw["dims"]["n_positions"] - 8
    assert all(row["decode_ms_per_token"] == row["decode_ms_per_token_median"] > 0 for row in rec["sweep"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_lengths_shrink_to_fit_a_short_model(tiny_export):
    """The tiny model has 128 positions: the 128 + 128 defaults shrink; --sweep (own contexts) works too."""
    r = bench(tiny_export, "--repeat", "1", "--sweep", "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    assert (rec["config"]["prompt_len"], rec["config"]["new_tokens"]) == (64, 64)
    assert "defaults shrunk to fit" in r.stderr and rec["sweep"]


@pytest.mark.parametrize(
    "args, lengths",
    [(["--prompt-len", "100"], (100, 28)), (["--new-tokens", "100"], (28, 100)), (["--prompt-len", "32"], (32, 96))],
)
def test_a_given_length_stays_and_the_default_one_fits_around_it(tiny_export, args, lengths):
    r = bench(tiny_export, *args, "--repeat", "1", "--json")
    assert r.exit_code == 0, r.output
    config = json.loads(r.stdout)["config"]
    assert (config["prompt_len"], config["new_tokens"]) == lengths


def test_bench_config_fits_defaults_for_library_callers():
    cfg = bench_module.BenchConfig()
    assert (cfg.fitted(1024).prompt_len, cfg.fitted(1024).new_tokens) == (128, 128)  # GPT-2: unchanged
    assert (cfg.fitted(128).prompt_len, cfg.fitted(128).new_tokens) == (64, 64)
    assert (cfg.fitted(5).prompt_len, cfg.fitted(5).new_tokens) == (2, 3)
    with pytest.raises(GenerationError, match="too short to bench"):
        cfg.fitted(2)


def test_bandwidth_floor_does_not_apply_when_a_step_fits_in_cache(tiny_export, llc):
    args = ("--prompt-len", "16", "--new-tokens", "8", "--repeat", "1")
    llc(1 << 30)
    r = bench(tiny_export, *args, "--json")
    rec = json.loads(r.stdout)
    assert rec["decode_vs_floor"] is None and rec["decode_vs_floor_best_run"] is None
    assert rec["decode_floor_ms"] is None and "last-level cache" in rec["decode_floor_note"]
    assert rec["last_level_cache_bytes"] == 1 << 30
    table = bench(tiny_export, *args).stdout
    floor_row = next(line for line in table.splitlines() if line.startswith("decode floor"))
    assert "does not apply" in floor_row and "x floor" not in floor_row
    llc(rec["bytes_read_per_step"] - 1)  # one byte short: every step reaches memory, the floor holds
    rec = json.loads(bench(tiny_export, *args, "--json").stdout)
    assert rec["decode_vs_floor"] > 0 and rec["decode_floor_note"] is None


def write_cache(index, level: int, kind: str, size: str) -> None:
    index.mkdir(parents=True)
    for name, value in (("level", f"{level}\n"), ("type", f"{kind}\n"), ("size", f"{size}\n")):
        (index / name).write_text(value)


def test_last_level_cache_size_from_sysfs_else_sysconf(tmp_path, monkeypatch):
    caches = tmp_path / "cache"
    write_cache(caches / "index0", 1, "Data", "48K")
    write_cache(caches / "index1", 1, "Instruction", "32K")
    write_cache(caches / "index2", 2, "Unified", "2048K")
    assert probe_module.last_level_cache_bytes(caches) == 2 << 20
    write_cache(caches / "index3", 3, "Unified", "96M")
    write_cache(caches / "index4", 4, "Unified", "garbage")  # unreadable entries are skipped
    assert probe_module.last_level_cache_bytes(caches) == 96 << 20
    # no sysfs: glibc's sysconf, and None when it does not know either
    monkeypatch.setattr(probe_module.os, "sysconf", lambda name: 8 << 20)
    assert probe_module.last_level_cache_bytes(tmp_path / "missing") == 8 << 20
    monkeypatch.setattr(probe_module.os, "sysconf", lambda name: 0)
    assert probe_module.last_level_cache_bytes(tmp_path / "missing") is None

    def unknown(name):
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr(probe_module.os, "sysconf", unknown)
    assert probe_module.last_level_cache_bytes(tmp_path / "missing") is None


def test_summarize_reads_records_without_a_floor(tiny_export, llc, tmp_path):
    """benchmarks/summarize.py prints n/a where the floor does not apply (it used to format the floor)."""
    llc(1 << 30)
    r = bench(tiny_export, "--prompt-len", "16", "--new-tokens", "8", "--repeat", "1", "--sweep", "--json")
    assert r.exit_code == 0, r.output
    (tmp_path / "bench-fp32.json").write_text(r.stdout)
    (tmp_path / "sweep-fp32.json").write_text(r.stdout)
    p = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "summarize.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert "| fp32 |" in p.stdout and "n/a" in p.stdout and "ratio last/first context" in p.stdout


def test_no_progress_bars_when_stderr_is_not_a_terminal(tiny_export):
    args = ["bench", str(tiny_export), "--prompt-len", "8", "--new-tokens", "4", "--repeat", "1", "--sweep"]
    p = subprocess.run(
        [sys.executable, "-m", "gpt2edge.cli", *args], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stderr and "%|" not in p.stderr, p.stderr  # no tqdm bar in a log file


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--prompt-len", "200"], "--prompt-len 200 + 2 new tokens exceeds the model's 128 positions"),
        (["--prompt-len", "127"], "exceeds the model's 128 positions; lower --prompt-len."),
        (["--new-tokens", "128"], "--new-tokens 128 exceeds the model's 128 positions"),
        (["--prompt-len", "64", "--new-tokens", "65"], "lower --prompt-len or --new-tokens"),
    ],
)
def test_given_lengths_that_do_not_fit_are_a_clear_error(tiny_export, args, phrase):
    r = bench(tiny_export, *args)
    assert r.exit_code == 1 and phrase in r.stderr and r.stderr.startswith("error: "), r.output


@pytest.mark.parametrize(
    "args",
    [
        ["--repeat", "0"],
        ["--batch", "0"],
        ["--threads", "0"],
        ["--threads", "100000"],
        ["--prompt-len", "0"],
        ["--new-tokens", "1"],
    ],
    ids=" ".join,
)
def test_out_of_range_options_are_refused_by_click(tiny_export, args):
    r = bench(tiny_export, *args)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "Invalid value for" in r.stderr and args[0] in r.stderr and "is not in the range" in r.stderr


def test_bench_times_beam_search_per_width(tiny_export_shared):
    from click.testing import CliRunner

    from gpt2edge.cli import main

    args = ["bench", str(tiny_export_shared), "--repeat", "1", "--new-tokens", "8", "--prompt-len", "8", "--json"]
    res = CliRunner().invoke(main, [*args, "--num-beams", "4", "--num-beams", "1", "--num-beams", "4"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["beam_search"]
    assert [r["num_beams"] for r in rows] == [1, 4] and [r["rows"] for r in rows] == [1, 4]
    for r in rows:
        parts = r["decode_ms_per_step"] + r["reorder_ms_per_step"] + r["select_ms_per_step"]
        assert r["step_ms"] > 0 and r["step_ms"] == pytest.approx(parts, rel=1e-6)  # one run: the sum itself
    bad = CliRunner().invoke(main, [*args, "--num-beams", "0"])
    assert bad.exit_code == 2 and "--num-beams" in bad.output


def test_an_emulated_cpu_gets_no_floor_and_is_named_emulated(tiny_export, monkeypatch, llc):
    """Under qemu-user (the aarch64 lane) the probes measure the host: bench says so instead of a floor."""
    from gpt2edge.cpu_facts import CpuFacts

    llc(1 << 20)  # the host's cache, which an emulated CPU must not report
    qemu = CpuFacts("aarch64", "Neoverse-N1, emulated: the kernel is x86", ("asimd",), "the kernel is x86")
    monkeypatch.setattr(bench_module, "this_cpu", lambda: qemu)
    args = ("--prompt-len", "8", "--new-tokens", "4", "--repeat", "1")
    rec = json.loads(bench(tiny_export, *args, "--json").stdout)
    assert rec["cpu_emulated"] == "the kernel is x86" and rec["cpu"].startswith("Neoverse-N1, emulated")
    assert rec["decode_floor_ms"] is None and rec["last_level_cache_bytes"] is None
    assert rec["decode_floor_note"].startswith("emulated CPU") and "no speed figure" in rec["decode_floor_note"]
    table = bench(tiny_export, *args).stdout
    assert any(line.startswith("cpu") and "emulated" in line for line in table.splitlines())

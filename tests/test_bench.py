"""`gpt2edge bench`: every field present and plausible, the sweep and its plot, bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.manifest import read_manifest

FIELDS = (
    "prefill_ms",
    "decode_ms_per_token",
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


def test_bench_json_fields_are_plausible(tiny_export):
    r = bench(tiny_export, "--prompt-len", "16", "--new-tokens", "8", "--repeat", "2", "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)  # stdout is pure JSON
    for f in FIELDS:
        assert rec[f] > 0, f
    assert rec["decode_ms_p90"] >= rec["decode_ms_per_token"]
    # the best run is one of the runs: no slower than the slowest, and its prefill no slower than the median
    assert rec["prefill_ms_best"] <= rec["prefill_ms"]
    assert rec["decode_ms_best_run"] <= rec["decode_ms_p90"]
    assert rec["decode_vs_floor_best_run"] == pytest.approx(rec["decode_ms_best_run"] / rec["decode_floor_ms"])
    manifest = read_manifest(tiny_export)
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
    assert contexts[0] == 32 and contexts[-1] == read_manifest(tiny_export)["dims"]["n_positions"] - 8
    assert all(row["decode_ms_per_token"] > 0 for row in rec["sweep"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--prompt-len", "200"], "exceeds the model's 128 positions"),
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--batch", "0"], "--batch must be >= 1"),
    ],
)
def test_bad_input(tiny_export, args, phrase):
    r = bench(tiny_export, *args)
    assert r.exit_code == 1 and phrase in r.output, r.output

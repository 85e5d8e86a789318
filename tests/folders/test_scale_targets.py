"""quantize --target: the target is found by running instructions (not from flags), recorded in the manifest,
and a folder made for any target runs correctly here, within the same quality thresholds as the defaults."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.cpu_facts import DYNAMIC_INT8, this_cpu
from gpt2edge.manifest import load_manifest
from gpt2edge.quantize import make_recipe, quantize_model
from gpt2edge.quantize import targets as tg
from gpt2edge.runtime import ModelFolder

THRESHOLDS = {"int8": {"mean_kl": 5e-3, "top1": 0.95}, "int4": {"mean_kl": 0.3, "top1": 0.5}}  # test_quantize's


def test_this_machine_runs_its_detected_target():
    report = tg.detect()
    assert report.target in tg.TARGETS and report.target in report.runs
    assert tg.probe(report.target) and tg.probe("generic")
    assert set(report.runs) <= set(report.advertised)  # never a target the flags do not list


def test_a_faulting_instruction_is_contained_and_not_chosen(monkeypatch):
    """An advertised set that faults (AMX on a VM) kills the probe's child only, and is not chosen."""
    monkeypatch.setattr(tg, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"})
    monkeypatch.setitem(tg._CODE, "amx", "0f0b")  # ud2: SIGILL, as a VM's unusable AMX does
    monkeypatch.setitem(tg._CODE, "avx512-vnni", "0f0b")
    assert not tg.probe("amx")
    found = tg.detect.__wrapped__()
    assert "amx" in found.advertised and "amx" not in found.runs
    assert found.target == ("avx2" if tg.probe("avx2") else "generic")


def test_unknown_target_is_refused_before_work(tiny_export, tmp_path):
    with pytest.raises(Exception, match="Unknown --target 'sse9'"):
        make_recipe("int4", target="sse9")
    out = tmp_path / "q"
    res = CliRunner().invoke(main, ["quantize", str(tiny_export), "-o", str(out), "--mode", "int4", "--target", "sse9"])
    assert res.exit_code != 0 and "sse9" in res.output and not out.exists()


def test_explicit_options_win_over_the_target():
    r = make_recipe("int4", block_size=64, symmetric=False, accuracy_level=0, target="avx2")
    assert (r.block_size, r.symmetric, r.accuracy_level, r.target) == (64, False, 0, "avx2")
    assert make_recipe("int4", target="avx2").symmetric  # the avx2 recipe's own choice
    assert make_recipe("int8", target="amx").int8_op == "DynamicQuantizeMatMul"


@pytest.mark.parametrize("target", tg.TARGETS)
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_folder_for_any_target_runs_here_within_thresholds(tiny_export, tmp_path, target, mode):
    out = tmp_path / f"{mode}-{target}"
    manifest = quantize_model(tiny_export, out, make_recipe(mode, target=target), log=None)
    recipe = manifest["quantization"]["recipe"]
    assert recipe["target"] == target and manifest["quantization"]["cpu"]["target"] == tg.detect().target
    q = manifest["quality"]
    if recipe.get("layer_op") == DYNAMIC_INT8 and this_cpu().u8s8_saturates:
        # per-column int8 DynamicQuantizeMatMul (the amx / arm64 recipes) saturates in ONNX Runtime's u8s8 kernel on
        # x86 without VNNI: the folder runs here, below the thresholds, and opening it says so in one line
        with pytest.warns(RuntimeWarning, match="no VNNI.*saturates"):
            ModelFolder.open(out)
    else:
        assert q["mean_kl"] <= THRESHOLDS[mode]["mean_kl"] and q["top1_agreement"] >= THRESHOLDS[mode]["top1"], q
    assert load_manifest(out).raw["quantization"]["recipe"]["target"] == target  # the folder loads with its record
    if mode == "int8" and target == "amx":
        assert recipe["layer_op"] == "com.microsoft.DynamicQuantizeMatMul"
    res = CliRunner().invoke(main, ["generate", str(out), "-p", "Hello", "--max-new-tokens", "4", "--seed", "0"])
    assert res.exit_code == 0, res.output


def test_unknown_target_in_a_manifest_is_refused(tiny_export, tmp_path):
    import json

    out = tmp_path / "q"
    quantize_model(tiny_export, out, make_recipe("int4", target="generic"), report=False, log=None)
    m = json.loads((out / "manifest.json").read_text())
    m["quantization"]["recipe"]["target"] = "sse9"
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(Exception, match="target"):
        ModelFolder.open(out, verify=False)

"""The aarch64 lane's parity rule (scripts/aarch64_parity.py; docs/parity.md): exact ids, except a near-tie for
folders whose kernels quantize activations to int8 differently per CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "aarch64_parity.py"
spec = importlib.util.spec_from_file_location("aarch64_parity", SCRIPT)
parity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(parity)

# the prompt's 3 ids, then 4 generated ones with the top-2 gap of each step
WANT = {"ids": [1, 2, 3, 10, 11, 12, 13], "gaps": [0.9, 0.05, 0.5, 0.2]}


def test_equal_ids_pass_everywhere():
    assert parity.verdict("fp32", WANT, list(WANT["ids"]), tolerant=False) == (True, "equal")


def test_a_difference_at_a_near_tie_passes_only_where_tolerated():
    got = [1, 2, 3, 10, 99, 98, 97]  # differs at step 1, where x86's gap is 0.05 nats
    ok, what = parity.verdict("int8", WANT, got, tolerant=True)
    assert ok and "near-tie" in what and "step 1" in what
    assert parity.verdict("int4", WANT, got, tolerant=False)[0] is False


def test_a_difference_at_a_wide_gap_fails_even_where_tolerated():
    got = [1, 2, 3, 10, 11, 99, 98]  # step 2: gap 0.5 > NEAR_TIE
    ok, what = parity.verdict("int8", WANT, got, tolerant=True)
    assert not ok and "DIFFERS from step 2" in what


def test_which_folders_are_tolerated():
    recipe = lambda **r: {"quantization": {"recipe": r}}  # noqa: E731
    tolerated = lambda m, **env: parity.near_tie_allowed(m, env=env)  # noqa: E731
    assert tolerated(recipe(mode="int8"))
    # the ARM recipes' int4 runs on MLAS's kernels (kleidiai: false): exact, as on x86
    arm_int4 = recipe(mode="int4", target="arm64-dotprod", accuracy_level=4, kleidiai=False)
    assert not tolerated(arm_int4)
    assert tolerated(arm_int4, GPT2EDGE_KLEIDIAI="1")  # KleidiAI asked back: per-row activations, near-ties
    assert tolerated(recipe(mode="int4", target="arm64-dotprod", accuracy_level=4))  # a folder from before
    assert not tolerated(recipe(mode="int4", accuracy_level=4))  # the built-in int4: exact
    assert not tolerated(recipe(mode="int4", target="arm64", accuracy_level=1))
    assert not tolerated({})  # fp32


def test_the_arm_recipes_record_kleidiai_off_and_their_sessions_apply_it(tiny_export, tmp_path, monkeypatch):
    """The ARM recipes whose int4 gives x86's ids only on MLAS's kernels record kleidiai: false, and every session of
    such a folder sets ONNX Runtime's mlas.disable_kleidiai (a no-op on x86; on ARM it keeps KleidiAI's per-row
    activation kernels off, scripts/arm_int4_repro.py); GPT2EDGE_KLEIDIAI=1 lifts it."""
    import json

    from gpt2edge.errors import ModelFolderError
    from gpt2edge.quantize import make_recipe, quantize_model
    from gpt2edge.quantize import targets as tg
    from gpt2edge.runtime.model.folder import ModelFolder
    from gpt2edge.runtime.model.ort_session import KLEIDIAI_KEY, kleidiai_off
    from gpt2edge.runtime.open_model import load_graph

    monkeypatch.setattr(tg, "detect", lambda: tg.CpuReport("x86", (), ("generic",), ("generic",), "generic"))
    monkeypatch.delenv("GPT2EDGE_KLEIDIAI", raising=False)
    for target in ("arm64-dotprod", "arm64-i8mm", "arm64-sve"):
        for mode in ("int4", "int8"):
            assert make_recipe(mode, target=target).to_json()["kleidiai"] is False
    for target in (None, "arm64", "avx512-vnni"):
        assert "kleidiai" not in make_recipe("int4", target=target).to_json()
    assert kleidiai_off((), env={}, recipe=False) is True
    assert kleidiai_off((), env={"GPT2EDGE_KLEIDIAI": "1"}, recipe=False) is False

    def entry(folder: Path) -> str | None:
        options = load_graph(ModelFolder.open(folder)).session.get_session_options()
        try:
            return options.get_session_config_entry(KLEIDIAI_KEY)
        except Exception:  # ONNX Runtime raises for a key never set
            return None

    arm = tmp_path / "int4-arm64-dotprod"
    quantize_model(tiny_export, arm, make_recipe("int4", target="arm64-dotprod"), force=True, report=False, log=None)
    manifest = json.loads((arm / "manifest.json").read_text())
    assert manifest["quantization"]["recipe"]["kleidiai"] is False
    assert ModelFolder.open(arm).kleidiai is False and entry(arm) == "1"
    built_in = tmp_path / "int4"
    quantize_model(tiny_export, built_in, make_recipe("int4"), force=True, report=False, log=None)
    assert ModelFolder.open(built_in).kleidiai is True and entry(built_in) != "1"
    monkeypatch.setenv("GPT2EDGE_KLEIDIAI", "1")
    assert entry(arm) != "1"
    # a manifest whose flag is not a boolean is refused, naming the field
    manifest["quantization"]["recipe"]["kleidiai"] = "off"
    (arm / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelFolderError, match="kleidiai"):
        ModelFolder.open(arm, verify=False)

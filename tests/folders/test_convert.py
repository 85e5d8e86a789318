"""gpt2edge convert: ORT format (minimal/mobile builds) and onnxruntime-genai folders, token-identical to the
export they come from; bad requests write nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.convert import convert_folder
from gpt2edge.convert.ort_format import required_operators
from gpt2edge.errors import ConvertError, ModelFolderError
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.folder import ModelFolder

PROMPTS = ["The river rose and", "Visitors"]  # unequal lengths: the batch is left-padded
N_NEW = 12


@pytest.fixture(scope="module")
def sources(tiny_export, tiny_export_shared, tiny_export_all, tmp_path_factory) -> dict[str, Path]:
    """Every graph kind convert must handle: fp32/fp16/int8/int4, concat and shared cache, both heads."""
    from gpt2edge.quantize import make_recipe, quantize_model

    root = tmp_path_factory.mktemp("variants")
    out = {"fp32": tiny_export, "fp32-shared": tiny_export_shared, "fp32-all": tiny_export_all}
    for name, src, mode in [
        ("fp16", tiny_export, "fp16"),
        ("int8", tiny_export, "int8"),
        ("int4", tiny_export, "int4"),
        ("int4-shared", tiny_export_shared, "int4"),
    ]:
        quantize_model(src, root / name, make_recipe(mode), report=False)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def ort_folders(sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ort")
    for name, src in sources.items():
        convert_folder(src, root / name, "ort")
    return {name: root / name for name in sources}


def greedy(folder: Path, prompts=PROMPTS) -> list[list[int]]:
    gen = Generator(folder)
    return [r.token_ids for r in gen.generate(prompts, max_new_tokens=N_NEW, do_sample=False, ignore_eos=True)]


def raw_greedy(session: ort.InferenceSession, folder: ModelFolder, ids: list[int], n: int) -> list[int]:
    """Greedy decoding with plain session.run (no IO binding, no gpt2edge runtime), batch 1."""
    d = folder.dims
    names = [i.name for i in session.get_inputs()][3:]
    # concat: the cache grows from empty; shared: one (1, nh, capacity, hs) buffer the graph writes in place
    length = len(ids) + n if folder.kv_cache == "shared" else 0
    past = [np.zeros((1, d["n_head"], length, d["head_dim"]), folder.kv_dtype)] * len(names)
    step, seen, out = list(ids), 0, []
    for _ in range(n):
        S = len(step)
        feed = {
            "input_ids": np.array([step], np.int64),
            "attention_mask": np.ones((1, seen + S), np.int64),
            "position_ids": np.arange(seen, seen + S, dtype=np.int64)[None],
        }
        res = session.run(None, {**feed, **dict(zip(names, past))})
        lp = res[0][0] if res[0].ndim == 2 else res[0][0, -1]  # (V,)
        past, seen = res[1:], seen + S
        step = [int(lp.argmax())]
        out.append(step[0])
    return out


# ---- ORT format ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp32", "fp32-shared", "fp32-all", "fp16", "int8", "int4", "int4-shared"])
def test_ort_folder_generates_the_same_greedy_tokens(sources, ort_folders, name):
    out = ort_folders[name]
    folder = ModelFolder.open(out)  # every checksum of the new folder holds
    assert folder.graph_format == "ort" and folder.graph_path.suffix == ".ort"
    assert folder.graph_path.read_bytes()[4:8] == b"ORTM"  # ONNX Runtime's FlatBuffer, not protobuf
    assert not any(p.suffix == ".onnx" for p in out.iterdir())
    for f in ("tokenizer.json", "config.json", "generation_config.json", "required_operators.config"):
        assert f in folder.manifest["files"]
    assert folder.manifest["conversion"]["optimization_style"] == "Fixed"
    assert greedy(out) == greedy(sources[name])


@pytest.mark.parametrize("name", ["fp32", "fp32-shared", "int8", "int4-shared"])
def test_ort_graph_runs_without_any_optimizer(sources, ort_folders, name):
    """A minimal build has no graph optimizers: the saved graph must run as it is."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.add_session_config_entry("session.load_model_format", "ORT")
    folder = ModelFolder.open(ort_folders[name])
    session = ort.InferenceSession(str(folder.graph_path), opts, providers=["CPUExecutionProvider"])
    prompt = Generator(sources[name]).tokenizer.encode(PROMPTS[0])
    expected = Generator(sources[name]).generate(PROMPTS[0], max_new_tokens=N_NEW, do_sample=False, ignore_eos=True)
    assert raw_greedy(session, folder, prompt, N_NEW) == expected.token_ids


def test_required_operators_config_lists_what_a_minimal_build_needs(ort_folders):
    ops = {name: required_operators(ort_folders[name] / "required_operators.config") for name in ort_folders}
    flat = {name: {op for names in v.values() for op in names} for name, v in ops.items()}
    assert "GroupQueryAttention" in flat["fp32-shared"] and "GroupQueryAttention" in flat["int4-shared"]
    assert "GroupQueryAttention" not in flat["fp32"]
    assert "MatMulNBits" in flat["int8"] and "MatMulNBits" in flat["int4"] and "MatMulNBits" not in flat["fp32"]
    assert any(k.startswith("com.microsoft;") for k in ops["int4-shared"])
    text = (ort_folders["fp32"] / "required_operators.config").read_text()
    assert "# - model.ort" in text and str(ort_folders["fp32"].parent) not in text  # no temporary absolute path


# ---- onnxruntime-genai --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def og():
    return pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")


@pytest.fixture(scope="module")
def genai_folders(sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("genai")
    names = ["fp32", "fp32-shared", "fp32-all", "int8", "int4-shared"]
    for name in names:
        convert_folder(sources[name], root / name, "genai")
    return {name: root / name for name in names}


def genai_greedy(og, folder: Path, ids: list[int], n: int) -> list[int]:
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + n, min_length=len(ids) + n)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(ids, dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)[len(ids) :]]


@pytest.mark.parametrize("name", ["fp32", "fp32-shared", "fp32-all", "int8", "int4-shared"])
def test_genai_generates_the_same_greedy_tokens(og, sources, genai_folders, name):
    ours = Generator(sources[name])
    for prompt in PROMPTS:
        r = ours.generate(prompt, max_new_tokens=N_NEW, do_sample=False, ignore_eos=True)
        assert genai_greedy(og, genai_folders[name], r.prompt_token_ids, N_NEW) == r.token_ids
        # genai's own tokenizer reads the folder's tokenizer.json + tokenizer_config.json the same way
        tok = og.Tokenizer(og.Model(str(genai_folders[name])))
        assert [int(t) for t in tok.encode(prompt)] == r.prompt_token_ids


def test_genai_folder_config_and_manifest(genai_folders):
    shared = json.loads((genai_folders["fp32-shared"] / "genai_config.json").read_text())
    concat = json.loads((genai_folders["fp32"] / "genai_config.json").read_text())
    assert shared["search"]["past_present_share_buffer"] and not concat["search"]["past_present_share_buffer"]
    assert concat["model"]["decoder"]["outputs"]["logits"] == "logits"
    all_head = json.loads((genai_folders["fp32-all"] / "genai_config.json").read_text())
    assert all_head["model"]["decoder"]["outputs"]["logits"] == "logprobs"  # already (B, S, V)
    manifest = json.loads((genai_folders["fp32"] / "manifest.json").read_text())
    assert manifest["graph"]["format"] == "genai"
    assert manifest["graph"]["outputs"][0] == {"name": "logits", "dtype": "float32", "shape": ["batch", 1, 400]}
    # gpt2edge's runtime refuses it with a pointer to genai (its graph returns logits of another rank)
    with pytest.raises(ModelFolderError, match="onnxruntime-genai folder"):
        Generator(genai_folders["fp32"])


# ---- bad requests -------------------------------------------------------------------------------------------


def convert_cli(*args):
    return CliRunner().invoke(main, ["convert", *map(str, args)])


def assert_refused(result, phrase: str, out: Path) -> None:
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert phrase in result.stderr, result.stderr
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no temporary leftovers


def test_bad_requests_are_one_line_errors_and_write_nothing(tiny_export, ort_folders, tmp_path):
    out = tmp_path / "out"
    bad_format = convert_cli(tiny_export, "-o", out, "--format", "tflite")  # click's Choice: a usage error
    assert bad_format.exit_code == 2 and "Invalid value for '--format'" in bad_format.stderr and not out.exists()
    with pytest.raises(ConvertError, match="Unknown format 'tflite'"):  # the library's own check
        convert_folder(tiny_export, out, "tflite")
    (tmp_path / "plain").mkdir()
    assert_refused(convert_cli(tmp_path / "plain", "-o", out, "--format", "ort"), "not a gpt2edge export", out)
    assert_refused(convert_cli(tmp_path / "missing", "-o", out, "--format", "ort"), "does not exist", out)
    assert_refused(convert_cli(ort_folders["fp32"], "-o", out, "--format", "genai"), "already a converted (ort)", out)
    same = convert_cli(tiny_export, "-o", tiny_export, "--format", "ort", "--force")
    assert same.exit_code == 1 and "output folder is the input folder" in same.stderr
    assert ModelFolder.open(tiny_export).graph_format == "onnx"  # untouched


def test_existing_output_needs_force(tiny_export, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    r = convert_cli(tiny_export, "-o", out, "--format", "ort")
    assert r.exit_code == 1 and "already exists; pass --force" in r.stderr
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    # --force replaces only a gpt2edge folder: the user's files stay
    r = convert_cli(tiny_export, "-o", out, "--format", "ort", "--force")
    assert r.exit_code == 1 and "not a gpt2edge folder" in r.stderr
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    (out / "mine.txt").unlink()
    assert convert_cli(tiny_export, "-o", out, "--format", "genai", "--force").exit_code == 0  # empty: replaceable
    r = convert_cli(tiny_export, "-o", out, "--format", "ort", "--force", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["graph"]["format"] == "ort"  # stdout is exactly the manifest: no converter chatter
    assert ModelFolder.open(out).graph_format == "ort"


def test_tampered_or_oversized_source_is_refused(tiny_export, tmp_path):
    bad = tmp_path / "tampered"
    shutil.copytree(tiny_export, bad)
    with open(bad / "model.onnx", "ab") as f:
        f.write(b"\0")
    out = tmp_path / "out"
    assert_refused(convert_cli(bad, "-o", out, "--format", "genai"), "does not match its manifest checksum", out)
    big = tmp_path / "big"
    shutil.copytree(tiny_export, big)
    manifest = json.loads((big / "manifest.json").read_text())
    manifest["files"]["model.onnx"]["size"] = 3 * 10**9
    (big / "manifest.json").write_text(json.dumps(manifest))
    assert_refused(convert_cli(big, "-o", out, "--format", "ort"), "under 2 GB", out)


def test_converter_failure_leaves_nothing(tiny_export, tmp_path, monkeypatch):
    import onnxruntime.tools.convert_onnx_models_to_ort as converter

    def broken(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : something inside\nmore detail")

    monkeypatch.setattr(converter, "convert_onnx_models_to_ort", broken)
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match="could not convert .* to ORT format: .*FAIL : something inside$"):
        convert_folder(tiny_export, out, "ort")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_runtime_reads_the_graph_format_from_the_manifest_not_the_file_name(ort_folders, tmp_path):
    from gpt2edge.runtime.model.ort_session import create_session

    renamed = tmp_path / "graph.bin"
    shutil.copy(ort_folders["fp32"] / "model.ort", renamed)
    assert create_session(renamed, model_format="ort").get_inputs()[0].name == "input_ids"
    with pytest.raises(Exception, match="(?i)protobuf|parse"):
        create_session(renamed)  # read as ONNX, the same bytes are not a model


def test_quantize_refuses_a_converted_folder(ort_folders, tmp_path):
    out = tmp_path / "q"
    r = CliRunner().invoke(main, ["quantize", str(ort_folders["fp32"]), "-o", str(out), "--mode", "int8"])
    assert_refused(r, "quantize the .onnx export it came from", out)

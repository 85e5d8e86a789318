"""Static-shape exports (`gpt2edge export --static BATCHxCHUNKxCAPACITY`): a verified folder of two graphs that
share one weights file, no symbolic dimension, one NNAPI / CoreML ML Program partition by ONNX Runtime's own
mobile usability checker, and the same greedy tokens as the dynamic export, through Generator, the CLI, score
and bench."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpt2edge.errors import ExportError, GenerationError, ModelFolderError
from gpt2edge.export.model import from_hf_model
from gpt2edge.export.static import (
    DECODE_FILE,
    PREFILL_FILE,
    WEIGHTS_FILE,
    StaticShape,
    parse_static,
    symbolic_values,
)
from gpt2edge.manifest import MANIFEST_NAME, Manifest, load_manifest, verify_files
from gpt2edge.runtime import Generator, ModelFolder
from gpt2edge.runtime.model.lm import OrtLM
from gpt2edge.runtime.model.static_lm import StaticLM
from gpt2edge.runtime.score import Scorer
from tests.support import cli

SHAPE = StaticShape(batch=2, chunk=8, capacity=64)
GREEDY = dict(max_new_tokens=16, do_sample=False, ignore_eos=True)
# 4 tokens (one padded chunk) and 13 (a full chunk of 8, then a padded one): neither a multiple of the chunk
PROMPTS = ["The river rose and", "Visitors came to the old town to see the bridge and the river"]


@pytest.fixture(scope="module")
def static_export(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("static") / "tiny-static"
    r = cli("export", "-m", tiny_checkpoint, out, "--static", str(SHAPE))
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def static_gen(static_export) -> Generator:
    return Generator(static_export)


@pytest.fixture(scope="module")
def dynamic_gen(tiny_export) -> Generator:
    return Generator(tiny_export)


# --- the folder ---------------------------------------------------------------------------------------------


def test_cli_export_writes_a_verified_static_folder(static_export):
    m = dict(load_manifest(static_export).raw)
    g = m["graph"]
    assert g["static"] == {
        "batch": 2,
        "chunk": 8,
        "capacity": 64,
        "prefill_file": PREFILL_FILE,
        "decode_file": DECODE_FILE,
    }
    assert g["file"] == PREFILL_FILE and g["files"] == [PREFILL_FILE, DECODE_FILE, WEIGHTS_FILE]
    assert g["kv_cache"] == "static" and g["head"] == "last"
    listed = {PREFILL_FILE, DECODE_FILE, WEIGHTS_FILE, "tokenizer.json", "config.json", "generation_config.json"}
    assert set(m["files"]) == listed == {p.name for p in static_export.iterdir()} - {MANIFEST_NAME}
    verify_files(static_export, m)  # every checksum holds
    modes = {(static_export / f).stat().st_mode & 0o777 for f in listed}
    assert len(modes) == 1  # weights.data too, though onnx's writer makes its files private
    # the manifest's IO description is all numbers too
    assert all(isinstance(d, int) for io in g["inputs"] + g["outputs"] for d in io["shape"])
    # validated against PyTorch at prefill (a full and a padded chunk, left-padded batch) and decode
    checks = m["validation"]["checks"]
    assert len(checks) == 4 and all(c["ok"] and c["maxdiff"] <= 1e-4 for c in checks)
    assert "2 chunk(s)" in checks[0]["case"] and checks[2]["case"].startswith("decode")


def test_two_graphs_store_the_weights_once(static_export, hf_model):
    weights = sum(p.numel() * 4 for p in from_hf_model(hf_model).parameters())
    sizes = {p.name: p.stat().st_size for p in static_export.iterdir()}
    assert 0.9 * weights < sizes[WEIGHTS_FILE] < 1.01 * weights  # one copy (tensors under 1 kB stay inline)
    # each graph file is its nodes (and their export metadata) only: far less than a copy of the weights
    assert sizes[PREFILL_FILE] < 0.5 * weights and sizes[DECODE_FILE] < 0.5 * weights


@pytest.mark.parametrize("name", [PREFILL_FILE, DECODE_FILE])
def test_no_symbolic_dimension_anywhere(static_export, name):
    assert symbolic_values(static_export / name) == []


@pytest.mark.parametrize("name", [PREFILL_FILE, DECODE_FILE])
def test_mobile_usability_checker_gives_nnapi_and_coreml_one_partition(static_export, name, tmp_path):
    # what `python -m onnxruntime.tools.check_onnx_model_mobile_usability` runs: basic optimization, shape
    # inference, then ONNX Runtime's partitioning estimate with every input size required to be fixed
    from onnxruntime.tools.mobile_helpers import usability_checker as uc
    from onnxruntime.tools.onnx_model_utils import ModelProtoWithShapeInfo, optimize_model

    optimized = tmp_path / name
    optimize_model(static_export / name, optimized, use_external_initializers=True)
    model = ModelProtoWithShapeInfo(optimized).model_with_shape_info
    assert uc.check_shapes(model.graph) == ([], 0)  # no dynamic input, no dynamic value
    yes = uc.PartitioningInfo.TryWithEP.YES
    nnapi = uc.check_nnapi_partitions(model, require_fixed_input_sizes=True)
    assert nnapi.num_partitions == 1 and nnapi.suitability() == yes
    coreml = uc.check_coreml_partitions(model, True, "coreml_supported_mlprogram_ops.md")
    assert coreml.num_partitions == 1 and coreml.suitability() == yes


# --- generation: the same tokens as the dynamic export ------------------------------------------------------


def test_generator_picks_the_static_runner(static_gen):
    assert isinstance(static_gen.lm, StaticLM) and static_gen.lm.n_positions == SHAPE.capacity


@pytest.mark.parametrize("io_binding", [True, False])
def test_greedy_tokens_equal_the_dynamic_export(static_export, dynamic_gen, io_binding):
    gen = Generator(static_export, io_binding=io_binding)
    for prompt in PROMPTS:
        assert len(dynamic_gen.tokenizer.encode(prompt)) % SHAPE.chunk != 0
        assert gen.generate(prompt, **GREEDY).token_ids == dynamic_gen.generate(prompt, **GREEDY).token_ids


def test_left_padded_batch_equals_the_dynamic_export(static_gen, dynamic_gen):
    ours = [r.token_ids for r in static_gen.generate(PROMPTS, **GREEDY)]
    assert ours == [r.token_ids for r in dynamic_gen.generate(PROMPTS, **GREEDY)]


def test_cli_generate_on_the_static_folder(static_export, tiny_export):
    def tokens(folder, *prompts):
        args = [a for p in prompts for a in ("-p", p)]
        r = cli("generate", folder, *args, "-n", "12", "--greedy", "--ignore-eos", "--json")
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        return [x["token_ids"] for x in out.get("results", [out])]

    assert tokens(static_export, PROMPTS[1]) == tokens(tiny_export, PROMPTS[1])  # batch 1
    assert tokens(static_export, *PROMPTS) == tokens(tiny_export, *PROMPTS)  # a left-padded batch of B
    r = cli("generate", static_export, "-p", "a", "-p", "b", "-p", "c", "-n", "2", "--json")
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "at most 2 rows" in r.output


def test_a_chunk_of_one_is_one_graph_for_prefill_and_decode(tiny_checkpoint, tmp_path, dynamic_gen):
    out = tmp_path / "one"
    r = cli("export", "-m", tiny_checkpoint, out, "--static", "1x1x32")
    assert r.exit_code == 0, r.output
    g = load_manifest(out).raw["graph"]
    assert g["files"] == [PREFILL_FILE, WEIGHTS_FILE] and g["static"]["decode_file"] == PREFILL_FILE
    assert symbolic_values(out / PREFILL_FILE) == []
    gen = Generator(out)
    assert gen.lm.graph.decode is gen.lm.graph.prefill
    assert gen.generate(PROMPTS[0], **GREEDY).token_ids == dynamic_gen.generate(PROMPTS[0], **GREEDY).token_ids


def test_concurrent_calls_each_get_their_own_cache(static_gen):
    """One StaticGraph, one StaticLM (cache, mask, bindings) per concurrent call: the same tokens as alone."""
    from concurrent.futures import ThreadPoolExecutor

    alone = [static_gen.generate(p, **GREEDY).token_ids for p in PROMPTS * 2]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: static_gen.generate(p, **GREEDY).token_ids, PROMPTS * 2))
    assert together == alone


def test_conversation_turns_equal_the_dynamic_export(static_gen, dynamic_gen):
    """A session feeds a turn's new tokens on top of its cache: chunks that start mid-cache."""
    outs = []
    for gen in (static_gen, dynamic_gen):
        s = gen.session()
        s.append(PROMPTS[1])
        first = s.generate(max_new_tokens=5, do_sample=False).token_ids
        s.append(" and then the water")
        outs.append((first, s.generate(max_new_tokens=5, do_sample=False).token_ids))
    assert outs[0] == outs[1]


def test_capacity_and_batch_limits_are_clear_errors(static_gen):
    with pytest.raises(GenerationError, match="64 positions"):
        static_gen.generate(PROMPTS[0], max_new_tokens=70, ignore_eos=True)
    with pytest.raises(GenerationError, match="at most 2 rows"):
        static_gen.generate(["a", "b", "c"], max_new_tokens=2)


def test_the_runner_checks_every_step_against_its_shapes(static_export):
    lm = StaticLM(static_export / PREFILL_FILE, static_export / DECODE_FILE)
    lm.start(1, 10)
    ids = np.zeros((1, 12), np.int64)
    with pytest.raises(GenerationError, match="does not fit"):
        lm.forward(np.zeros((2, 1), np.int64), np.ones((2, 1), np.int64), np.zeros((2, 1), np.int64))
    lm.forward(ids, np.ones((1, 12), np.int64), np.arange(12)[None])  # within capacity: fine
    with pytest.raises(GenerationError, match="does not fit"):
        lm.forward(np.zeros((1, 60), np.int64), np.ones((1, 72), np.int64), np.arange(12, 72)[None])


# --- score, bench, and the commands that refuse a static folder ---------------------------------------------


def test_token_by_token_score_equals_the_dynamic_export(static_export, tiny_export):
    text = " ".join(PROMPTS * 6)  # longer than the capacity: several windows of at most 64
    ours = Scorer(ModelFolder.open(static_export)).score(text)
    assert ours.method == "token-by-token" and ours.max_length == SHAPE.capacity and ours.windows > 1
    theirs = Scorer(ModelFolder.open(tiny_export)).score(text, max_length=SHAPE.capacity)
    scored = [(a, b) for a, b in zip(ours.token_logprobs, theirs.token_logprobs) if a is not None]
    assert len(scored) == ours.scored_tokens == theirs.scored_tokens
    assert max(abs(a - b) for a, b in scored) < 1e-4


def test_parity_report_against_the_dynamic_export(static_export, tiny_export):
    from gpt2edge.quality import compare_folders

    # the default stream (256 tokens) and greedy plan fit the 64 slots, on both sides alike
    report = compare_folders(tiny_export, static_export)
    assert report["tokens"] == SHAPE.capacity and report["top1_agreement"] == 1.0
    assert report["max_abs_logprob_diff"] < 1e-4 and report["greedy_match"] == report["greedy_tokens"] > 0


def test_bench_fits_the_capacity_and_refuses_a_larger_batch(static_export):
    from gpt2edge.bench.workload import BenchConfig, Workload

    work = Workload(static_export, BenchConfig(repeat=1))
    assert (work.cfg.prompt_len, work.cfg.new_tokens) == (32, 32)  # defaults shrunk to the 64 slots
    assert len(work.run(8, 4).decode_ms) == 3
    with pytest.raises(GenerationError, match="at most 2 rows"):
        Workload(static_export, BenchConfig(batch=3, repeat=1))


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["quantize", "-o", "{out}", "--mode", "int8", "--no-report"], "static-shape export"),
        (["convert", "-o", "{out}", "--format", "ort"], "static-shape export"),
        (["convert", "-o", "{out}", "--format", "genai"], "static-shape export"),
        (["trim-vocab", "-o", "{out}", "--keep-ids", "{ids}", "--no-report"], "static-shape export"),
    ],
)
def test_commands_that_rewrite_one_graph_refuse_a_static_folder(static_export, tmp_path, args, phrase):
    ids = tmp_path / "ids.txt"
    ids.write_text("1\n2\n")
    args = [a.format(out=tmp_path / "out", ids=ids) for a in args]
    r = cli(args[0], static_export, *args[1:])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and phrase in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_the_dynamic_runner_refuses_a_static_folder(static_export):
    with pytest.raises(ModelFolderError, match="static-shape export"):
        OrtLM(ModelFolder.open(static_export))


# --- bad requests and bad folders -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, phrase",
    [
        ("1x64", "BATCHxCHUNKxCAPACITY"),
        ("ax8x64", "BATCHxCHUNKxCAPACITY"),
        ("0x8x64", ">= 1"),
        ("1x0x64", ">= 1"),
        ("1x1x1", "capacity >= 2"),
        ("1x128x64", "cannot exceed"),
        ("1x8x4096", "exceeds"),
    ],
)
def test_bad_static_specs(spec, phrase):
    with pytest.raises(ExportError, match=phrase):
        parse_static(spec, n_positions=1024)
    assert parse_static("1X64x1024", 1024) == StaticShape(1, 64, 1024)


@pytest.mark.parametrize(
    "extra, phrase",
    [
        (["--static", "1x128x64"], "cannot exceed the capacity"),
        (["--static", "1x8x4096"], "exceeds the model's 128 positions"),
        (["--static", "1x8"], "BATCHxCHUNKxCAPACITY"),
        (["--static", "1x8x64", "--head", "all"], "--head all"),
        (["--static", "1x8x64", "--kv-cache", "shared"], "--kv-cache shared"),
    ],
)
def test_cli_refuses_bad_static_requests_in_one_line(tiny_checkpoint, tmp_path, extra, phrase):
    out = tmp_path / "out"
    r = cli("export", "-m", tiny_checkpoint, out, *extra)
    assert r.exit_code == 1 and r.output.count("\n") == 1 and phrase in r.output, r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", [WEIGHTS_FILE, DECODE_FILE, PREFILL_FILE])
def test_a_tampered_static_folder_is_refused(static_export, tmp_path, name):
    folder = tmp_path / "copy"
    shutil.copytree(static_export, folder)
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / name).write_bytes(bytes(data))
    with pytest.raises(ModelFolderError, match="does not match its manifest checksum"):
        Generator(folder)


def _static_manifest(static_export, **static) -> dict:
    m = json.loads((static_export / MANIFEST_NAME).read_text())
    m["graph"]["static"].update(static)
    return m


@pytest.mark.parametrize(
    "edit, phrase",
    [
        (dict(decode_file="../decode.onnx"), "leaves the folder"),
        (dict(prefill_file="/tmp/prefill.onnx"), "is absolute"),
        (dict(decode_file="other.onnx"), "must hold its decode_file"),
        (dict(decode_file=PREFILL_FILE), "own decode graph"),
        (dict(prefill_file=WEIGHTS_FILE), "graph.file must be"),
        (dict(chunk=65), "exceeds its capacity"),
        (dict(capacity=4096, chunk=8), "exceeds dims.n_positions"),
        (dict(batch=0), "positive integer"),
        (dict(chunk=True), "positive integer"),
    ],
)
def test_bad_static_manifests_are_refused(static_export, edit, phrase):
    with pytest.raises(ModelFolderError, match=phrase):
        Manifest.from_json(_static_manifest(static_export, **edit))


def test_static_marker_and_description_come_together(static_export):
    m = _static_manifest(static_export)
    del m["graph"]["static"]
    with pytest.raises(ModelFolderError, match="needs graph.static"):
        Manifest.from_json(m)
    m = _static_manifest(static_export)
    m["graph"]["kv_cache"] = "concat"
    with pytest.raises(ModelFolderError, match="needs graph.static"):
        Manifest.from_json(m)
    m = _static_manifest(static_export)
    m["graph"]["head"] = "all"
    with pytest.raises(ModelFolderError, match="head 'last'"):
        Manifest.from_json(m)


def test_beams_and_several_samples_are_refused_on_a_static_folder(static_gen):
    with pytest.raises(GenerationError, match="static-shape export"):
        static_gen.generate("The river", num_beams=2, max_new_tokens=4)
    with pytest.raises(GenerationError, match="static-shape export"):
        static_gen.generate("The river", num_return_sequences=2, do_sample=True, max_new_tokens=4)

"""ONNX Runtime session creation: provider choice, threads, and clear errors when a device is missing."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from gpt2edge import cpu_facts
from gpt2edge.errors import DeviceError, ModelFolderError
from gpt2edge.runtime.model import graph_cache
from gpt2edge.runtime.model.graph_cache import GraphCache
from gpt2edge.runtime.model.mapped_graph import mapped_model

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# IO binding names the memory of each device this way
ORT_DEVICE = {"cpu": "cpu", "cuda": "cuda"}
# more intra-op threads than cores only slows a matmul down; allow some oversubscription, refuse the absurd
# (ONNX Runtime starts every requested thread: 100000 of them is gigabytes of stacks)
MAX_THREADS = max(os.cpu_count() or 1, 256)
# ONNX Runtime's CPU provider has no fp16 MatMul on x86: it casts fp16 weights to fp32, and at ORT_ENABLE_ALL this
# transformer folds each cast into an fp32 copy of the weight kept beside the fp16 one (an fp16 gpt2-large session
# peaked at 4.85 GB for 1.5 GB of fp16 weights). A lean session keeps the casts as runtime ops instead.
FP16_FOLDING = "FuseFp16InitializerToFp32NodeTransformer"
# ONNX Runtime's KleidiAI kernels (ONNX Runtime's session config key, documented in its
# onnxruntime_session_options_config_keys.h) are turned off in two cases (docs/arm.md):
# - a CPU with SME: under emulated SME (QEMU `max`) DynamicQuantizeMatMul's SME2 path gave wrong sums where MLAS's own
#   NEON kernels and a NumPy reference agree (scripts/arm_sme_repro.py); until real SME hardware says otherwise those
#   CPUs run MLAS's kernels;
# - a folder whose recipe records kleidiai: false (arm64-dotprod / -i8mm / -sve): KleidiAI's 4-bit kernels quantize
#   activations per row where MLAS (x86's and ARM's alike) quantizes per block of 32, and their greedy ids left
#   x86's (scripts/arm_int4_repro.py); MLAS's kernels give x86's ids.
# GPT2EDGE_KLEIDIAI=1 keeps KleidiAI on in both cases (faster int4 where its kernels run, ids no longer x86's).
KLEIDIAI_KEY = "mlas.disable_kleidiai"


def kleidiai_off(features: tuple[str, ...] | None = None, env: dict | None = None, recipe: bool = True) -> bool:
    """Whether a session turns KleidiAI off: an SME CPU (HWCAP2), or a folder whose recipe keeps it off (`recipe`
    False), unless GPT2EDGE_KLEIDIAI=1 asks for it."""
    env = os.environ if env is None else env
    if env.get("GPT2EDGE_KLEIDIAI") == "1":
        return False
    if not recipe:
        return True
    if features is None:
        features = cpu_facts.this_cpu().features
    return "sme" in features


def ort_message(e: BaseException) -> str:
    """The first line of an ONNX Runtime error, without its '[ONNXRuntimeError] : 7 : INVALID_PROTOBUF :' prefix."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return lines[0].rsplit(" : ", 1)[-1].strip()[:300]


# what InferenceSession.run raises: RuntimeError under IO binding, ORT's own types (no common base) otherwise
ORT_RUN_ERRORS = (RuntimeError, _ort_state.Fail, _ort_state.InvalidArgument, _ort_state.RuntimeException)


def quiet_run_options() -> ort.RunOptions:
    """Run options that keep ONNX Runtime from logging a failed run itself: run_errors reports it, in one line."""
    opts = ort.RunOptions()
    opts.log_severity_level = 4  # fatal only
    # onnxruntime >= 1.32's run_with_iobinding looks this entry up on every run, and a missing one costs a C++
    # exception: ~33 us a step (10-15 % of a small model's decode step). "0" is the default graph id.
    opts.add_run_config_entry("gpu_graph_id", "0")
    return opts


@contextlib.contextmanager
def run_errors(graph: Path) -> Iterator[None]:
    """An ONNX Runtime failure while running `graph` (an index past the graph's positions or vocabulary, a
    shape it does not take) as one ModelFolderError: the folder's manifest or files do not describe the graph."""
    try:
        yield
    except ORT_RUN_ERRORS as e:
        raise ModelFolderError(
            f"ONNX Runtime failed running {graph} ({ort_message(e)}); the manifest (dims such as n_positions or "
            "vocab_size) or the tokenizer does not match the graph: export the model again."
        ) from e


def host_rows_refusal(device: str) -> str | None:
    """Why cache rows kept in host memory (SlotLM) cannot serve a graph on `device`; None on the CPU."""
    return None if device == "cpu" else f"the cache rows live in CPU memory and this folder runs on {device}"


def available_devices() -> list[str]:
    have = set(ort.get_available_providers())
    return [d for d, p in PROVIDERS.items() if p in have]


def check_threads(threads: int | None) -> None:
    """None (ONNX Runtime's choice) or an int in 1..MAX_THREADS; anything else is a DeviceError."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise DeviceError(
            f"--threads must be an integer from 1 to {MAX_THREADS} (this machine has {os.cpu_count()} CPUs), "
            f"got {threads!r}."
        )


def lean_options(opts: ort.SessionOptions, precision: str | None) -> list[str]:
    """Set `opts` for the least memory a session can run in without changing what it computes; returns the
    optimizers to disable.

    Measured on gpt2-small fp16 (peak RSS of a session that runs once: 851 MB default, 485 MB lean): the fp16
    weights stay fp16 (FP16_FOLDING off) and each cast runs just before its MatMul (PRIORITY_BASED order: the
    default order runs every cast first, so all fp32 copies were alive at once). An fp32 graph also loses
    prepacking (its MatMuls keep a packed copy of each weight beside the original: small 855 MB -> 499 MB of
    heap; same results up to rounding). int8/int4 kernels keep theirs: without it they take another, differently
    rounded path."""
    opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if precision == "fp32":
        opts.add_session_config_entry("session.disable_prepacking", "1")
        opts.enable_cpu_mem_arena = False
    return [FP16_FOLDING]


def mapped_source(graph: Path, opts: ort.SessionOptions) -> str | bytes:
    """What a lean session loads: a self-contained graph's message with its weights left in the file for ONNX
    Runtime to map (gpt2edge.runtime.model.mapped_graph: gpt2-small's one-file fp32 session peaks 0.13 GB lower,
    no protobuf copy of the weights), `opts` told the file's folder; the path itself when nothing is to be mapped
    (weights already external) or the file is not a readable protobuf (ONNX Runtime then says why)."""
    try:
        model = mapped_model(graph)
    except (OSError, ValueError):
        return str(graph)
    if model is None:
        return str(graph)
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(Path(graph).parent))
    return model


def create_session(
    graph: Path, device: str = "cpu", threads: int | None = None, model_format: str = "onnx", spin: bool = True,
    lean: bool = False, precision: str | None = None, kleidiai: bool = True, cache: GraphCache | None = None,
) -> ort.InferenceSession:  # fmt: skip
    """A session on `device` ('cpu' or 'cuda'); raises DeviceError rather than silently falling back.

    model_format "ort" loads ONNX Runtime's own format (gpt2edge convert --format ort) whatever the file name.
    spin=False: the intra-op threads sleep between runs instead of spinning (speculative decoding alternates
    two sessions, whose spinning threads would otherwise take the cores the other one runs on).
    lean=True: memory over speed, for one-off runs such as the quality report (lean_options; `precision`, the
    weights' as the manifest says, decides whether prepacking may go; a one-file graph's weights mapped from the
    file, mapped_source); the same graph, values equal up to the GEMMs' rounding (tests/folders/test_scale_memory.py).
    kleidiai=False: the folder's recipe keeps ONNX Runtime's KleidiAI kernels off (ModelFolder.kleidiai, kleidiai_off).
    cache: the folder's entry in the optimized-graph cache (gpt2edge.runtime.model.graph_cache): a CPU session
    of an .onnx graph loads the graph optimized by an earlier start, or saves the one it optimizes.
    """
    if device not in PROVIDERS:
        raise DeviceError(f"Unknown device '{device}'; choose one of {', '.join(PROVIDERS)}.")
    check_threads(threads)
    if PROVIDERS[device] not in ort.get_available_providers():
        raise DeviceError(
            f"Device '{device}' was requested but this onnxruntime ({ort.__version__}) has no "
            f"{PROVIDERS[device]}; install the GPU build with `bash scripts/setup.sh --gpu` "
            "(onnxruntime-gpu replaces onnxruntime), or use --device cpu."
        )
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    disabled = lean_options(opts, precision) if lean else []
    if threads:
        opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1  # one graph at a time: parallelism lives inside the matmuls
    if device == "cpu" and kleidiai_off(recipe=kleidiai):
        opts.add_session_config_entry(KLEIDIAI_KEY, "1")
    if device == "cpu":  # errors only (they become one-line errors here); CUDA keeps its log (why it fell back)
        opts.log_severity_level = 3
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if model_format == "ort":
        # said explicitly rather than left to the file suffix; the .ort graph was optimized when converted
        opts.add_session_config_entry("session.load_model_format", "ORT")
    source = mapped_source(graph, opts) if lean and model_format == "onnx" else str(graph)
    providers = [PROVIDERS[device]] if device == "cpu" else [PROVIDERS[device], PROVIDERS["cpu"]]
    if cache is not None and device == "cpu" and model_format == "onnx" and not lean and graph_cache.enabled():
        # the options that change what the optimizers write name the entry (threads and spinning do not)
        options = (
            ("level", "all"),
            ("disabled", ",".join(disabled)),
            (KLEIDIAI_KEY, str(kleidiai_off(recipe=kleidiai))),
        )
        entry = dataclasses.replace(cache, options=options)
        sess = cached_session(entry, graph, opts, providers, disabled)
    else:
        sess = _session(graph, source, opts, providers, disabled, device)
    if PROVIDERS[device] not in sess.get_providers():
        # ORT falls back to CPU when CUDA libraries fail to load; say so instead of running slowly
        raise DeviceError(
            f"{PROVIDERS[device]} is installed but could not start (CUDA/cuDNN libraries missing?); "
            "see onnxruntime's log above, or use --device cpu."
        )
    return sess


def _session(graph: Path, source: str | bytes, opts, providers: list[str], disabled: list[str], device: str):
    try:
        return ort.InferenceSession(source, sess_options=opts, providers=providers, disabled_optimizers=disabled)
    except Exception as e:  # ORT's own exception types (InvalidProtobuf, Fail, ...) share no base but Exception
        raise ModelFolderError(
            f"ONNX Runtime cannot load {graph} on {device} ({ort_message(e)}); if the file was changed or "
            "truncated, export the model again."
        ) from e


def cached_session(
    entry: GraphCache, graph: Path, opts: ort.SessionOptions, providers: list[str], disabled: list[str]
) -> ort.InferenceSession:
    """A session of the cached optimized graph when `entry` holds a usable one (loaded at ORT_DISABLE_ALL: it is
    optimized already, its weights mapped from the cache file); else a session of `graph` that saves its
    optimized graph into the cache for the next start."""
    cached = entry.usable()
    if cached is not None:
        level = opts.graph_optimization_level
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            return ort.InferenceSession(str(cached), sess_options=opts, providers=providers)
        except Exception as e:  # a file damaged in a way its record could not see: say so, and rebuild
            warnings.warn(
                f"the optimized graph cached in {entry.dir} does not load ({ort_message(e)}); rebuilding it",
                RuntimeWarning,
                stacklevel=2,
            )
            shutil.rmtree(entry.dir, ignore_errors=True)
            opts.graph_optimization_level = level
    try:
        before = entry.key()
        tmp = entry.writer(sum(os.path.getsize(p) for p in entry.source_paths()))
    except OSError:  # a source that cannot be stat'ed: ONNX Runtime's load names it
        tmp = None
    if tmp is not None:
        opts.optimized_model_filepath = str(tmp / graph_cache.GRAPH_NAME)
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", graph_cache.DATA_NAME)
        opts.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", str(graph_cache.EXTERNAL_MIN_BYTES)
        )
    try:
        sess = _session(graph, str(graph), opts, providers, disabled, "cpu")
    except ModelFolderError:
        if tmp is None:
            raise
        # the cache is optional: a save ONNX Runtime could not write (a full disk, a quota, a removed temp folder)
        # must not stop the model loading; without it, a real load error is still raised (by the same call)
        shutil.rmtree(tmp, ignore_errors=True)
        opts.optimized_model_filepath = ""
        sess = _session(graph, str(graph), opts, providers, disabled, "cpu")
        warnings.warn("the optimized graph could not be cached (ONNX Runtime could not save it)", RuntimeWarning,
                      stacklevel=2)  # fmt: skip
        return sess
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if tmp is not None:
        entry.commit(tmp, before)
    return sess

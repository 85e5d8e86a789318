"""A compact KV cache: a graph rewrite that stores the past/present tensors in float16 or int8.

`--kv-dtype fp16|int8` (export and quantize) rewrites a finished folder's graph; the weights are not touched.

concat graphs: each layer's new key/value is rounded to the cache's dtype before the Concat that makes the
  present, and the attention reads the present widened back to float32 (Cast, and for int8 a multiply by the
  scales): the attention always sees exactly what the cache holds, in this step and the next ones.
shared graphs: GroupQueryAttention reads and writes the cache in place in its own dtype. fp16: the query/key/value
  projection and the mask bias are cast to float16 and the attention's output back to float32. int8: ONNX
  Runtime's quantized-KV GroupQueryAttention (k_quant_type / v_quant_type PER_CHANNEL, kv_cache_bit_width 8,
  k_scale / v_scale): it quantizes the new entries as it writes them and dequantizes as it reads.

int8 scales are static and symmetric: the largest |entry| of a calibration prefill (the built-in sample text)
/ 127, entries beyond it saturate; one per (layer, key or value) by default, stored as a (1, n_head, 1, head_dim)
array (GroupQueryAttention's PER_CHANNEL form) so that per-head and per-channel scales use the same graph.
Per-tensor was measured against per-head and per-(head, channel) scales on the trained model and had the lowest
error (benchmarks/README.md, "Compact KV cache": a tight static scale clips what the calibration text did not
show). Static scales keep the cache one int8 tensor per key and value (no scale tensors beside it): the runtime
binds it like any other cache, IO binding and the in-place cache unchanged. Per-token scales would need a second
cache tensor of scales, which GroupQueryAttention does not take.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gpt2edge.errors import QuantizeError
from gpt2edge.export.options import KV_DTYPE_CHOICES

# --kv-dtype (export's and quantize's one list of choices) -> graph.kv_dtype
KV_DTYPES = dict(zip(KV_DTYPE_CHOICES, ("float32", "float16", "int8"), strict=True))
_ELEM = {"float16": TensorProto.FLOAT16, "int8": TensorProto.INT8}
SCALE_GRANULARITIES = ("per-channel", "per-head", "per-tensor")
DEFAULT_GRANULARITY = "per-tensor"  # measured best (benchmarks/README.md, "Compact KV cache")
CALIBRATION_TOKENS = 512
_FP16_BIAS_FLOOR = -32768.0  # the mask's float32 floor (-1.7e38) is -inf in float16; this stays finite
_PAST, _PRESENT = "past_key_values.", "present."


def kv_dtype_of(choice: str) -> str:
    """'fp16' -> 'float16'; an unknown choice refused in one line."""
    if choice not in KV_DTYPES:
        raise QuantizeError(f"Unknown --kv-dtype '{choice}'; choose one of {', '.join(KV_DTYPES)}.")
    return KV_DTYPES[choice]


def calibrate(
    graph_path: Path, tokens: list[int], granularity: str = DEFAULT_GRANULARITY, shared: bool = False
) -> list[np.ndarray]:
    """int8 scales, one (1, nh, 1, hs) float32 array per past tensor (key_0, value_0, ...): each the largest
    |entry| the fp32 graph writes for a prefill of `tokens`, / 127, reduced to the granularity asked. `shared`: a
    shared-cache graph, whose past is a buffer."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(graph_path), opts, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}
    past = [n for n in inputs if n.startswith(_PAST)]
    present = [o.name for o in sess.get_outputs() if o.name.startswith(_PRESENT)]
    T = len(tokens)
    _, nh, _, hs = inputs[past[0]].shape
    feed: dict[str, np.ndarray] = {
        "input_ids": np.array([tokens], np.int64),
        "attention_mask": np.ones((1, T), np.int64),
        "position_ids": np.arange(T, dtype=np.int64)[None],
    }
    if "logits_to_keep" in inputs:
        feed["logits_to_keep"] = np.array([T - 1], np.int64)
    for n in past:  # a shared graph's past is the buffer (capacity T); a concat graph's the empty past
        feed[n] = np.zeros((1, nh, T if shared else 0, hs), np.float32)
    outs = sess.run(present, feed)
    scales = []
    for out in outs:
        top = np.abs(out[:, :, :T]).max(axis=(0, 2), keepdims=True)  # (1, nh, 1, hs)
        if granularity == "per-head":
            top = np.broadcast_to(top.max(axis=3, keepdims=True), top.shape)
        elif granularity == "per-tensor":
            top = np.full(top.shape, top.max())
        elif granularity != "per-channel":
            raise QuantizeError(f"Unknown scale granularity '{granularity}'; choose one of {SCALE_GRANULARITIES}.")
        scales.append((np.maximum(top, 1e-8) / 127.0).astype(np.float32))
    return scales


def rewrite(model: onnx.ModelProto, kv_dtype: str, scales: list[np.ndarray] | None = None) -> None:
    """Make `model`'s past/present tensors `kv_dtype` ("float16" or "int8"; int8 needs `scales`, one per past
    input in order), in place."""
    g = model.graph
    past = [i.name for i in g.input if i.name.startswith(_PAST)]
    if kv_dtype == "int8" and (scales is None or len(scales) != len(past)):
        raise ValueError("an int8 KV cache needs one scale array per past tensor")
    elem = _ELEM[kv_dtype]
    for vi in [*g.input, *g.output]:
        if vi.name.startswith((_PAST, _PRESENT)):
            vi.type.tensor_type.elem_type = elem
    retyped = {n for n in past} | {o.name for o in g.output if o.name.startswith(_PRESENT)}
    kept = [vi for vi in g.value_info if vi.name not in retyped]
    del g.value_info[:]
    g.value_info.extend(kept)
    scale_of = {}
    if scales is not None:
        for name, s in zip(past, scales):
            init = numpy_helper.from_array(np.ascontiguousarray(s, np.float32), f"kv_scale/{name[len(_PAST) :]}")
            g.initializer.append(init)
            scale_of[name] = init.name
    if any(n.op_type == "GroupQueryAttention" for n in g.node):
        _rewrite_shared(g, kv_dtype, scale_of)
    else:
        _rewrite_concat(g, kv_dtype, scale_of, set(past))


def _rewrite_concat(g: onnx.GraphProto, kv_dtype: str, scale_of: dict[str, str], past: set[str]) -> None:
    outputs = {o.name for o in g.output}
    new_nodes: list[onnx.NodeProto] = []
    renamed: dict[str, str] = {}  # a present -> its float32 form, for the attention's nodes
    ours: set[int] = set()  # the Concats and the widening nodes, which read the stored present
    if kv_dtype == "int8":
        g.initializer.extend(
            [numpy_helper.from_array(np.array(v, np.float32), f"kv_scale/{k}") for k, v in (("lo", -128), ("hi", 127))]
        )
    for node in g.node:
        if node.op_type == "Concat" and node.input[0] in past and node.output[0] in outputs:
            name, new, present = node.input[0], node.input[1], node.output[0]
            if kv_dtype == "float16":
                new_nodes.append(helper.make_node("Cast", [new], [f"{new}/kv"], to=TensorProto.FLOAT16))
            else:
                s = scale_of[name]
                new_nodes += [
                    helper.make_node("Div", [new, s], [f"{new}/kv_div"]),
                    helper.make_node("Round", [f"{new}/kv_div"], [f"{new}/kv_round"]),
                    helper.make_node("Clip", [f"{new}/kv_round", "kv_scale/lo", "kv_scale/hi"], [f"{new}/kv_clip"]),
                    helper.make_node("Cast", [f"{new}/kv_clip"], [f"{new}/kv"], to=TensorProto.INT8),
                ]
            node.input[1] = f"{new}/kv"
            new_nodes.append(node)
            wide = f"{present}/f32"
            if kv_dtype == "float16":
                widen = [helper.make_node("Cast", [present], [wide], to=TensorProto.FLOAT)]
            else:
                widen = [
                    helper.make_node("Cast", [present], [f"{present}/i2f"], to=TensorProto.FLOAT),
                    helper.make_node("Mul", [f"{present}/i2f", scale_of[name]], [wide]),
                ]
            new_nodes += widen
            ours.update(id(n) for n in (node, *widen))
            renamed[present] = wide
        else:
            new_nodes.append(node)
    if len(renamed) != len(past):
        raise QuantizeError("The graph's KV cache is not the Concat form gpt2edge exports; re-export the model.")
    for node in new_nodes:  # the attention reads the widened present
        if id(node) not in ours:
            for i, t in enumerate(node.input):
                if t in renamed:
                    node.input[i] = renamed[t]
    del g.node[:]
    g.node.extend(new_nodes)


def _rewrite_shared(g: onnx.GraphProto, kv_dtype: str, scale_of: dict[str, str]) -> None:
    new_nodes: list[onnx.NodeProto] = []
    bias16: dict[str, str] = {}
    if kv_dtype == "float16":
        g.initializer.append(numpy_helper.from_array(np.array(_FP16_BIAS_FLOOR, np.float32), "kv_bias_floor"))
    for node in g.node:
        if node.op_type != "GroupQueryAttention":
            new_nodes.append(node)
            continue
        if kv_dtype == "float16":
            qkv, y = node.input[0], node.output[0]
            new_nodes.append(helper.make_node("Cast", [qkv], [f"{qkv}/f16"], to=TensorProto.FLOAT16))
            node.input[0] = f"{qkv}/f16"
            bias = node.input[10] if len(node.input) > 10 else ""
            if bias:
                if bias not in bias16:  # one cast of the shared mask bias for every layer
                    new_nodes += [
                        helper.make_node("Max", [bias, "kv_bias_floor"], [f"{bias}/floored"]),
                        helper.make_node("Cast", [f"{bias}/floored"], [f"{bias}/f16"], to=TensorProto.FLOAT16),
                    ]
                    bias16[bias] = f"{bias}/f16"
                node.input[10] = bias16[bias]
            node.output[0] = f"{y}/f16"
            new_nodes += [node, helper.make_node("Cast", [f"{y}/f16"], [y], to=TensorProto.FLOAT)]
        else:
            ins = list(node.input) + [""] * (12 - len(node.input))
            ins = ins[:12] + [scale_of[node.input[3]], scale_of[node.input[4]]]
            del node.input[:]
            node.input.extend(ins)
            node.attribute.extend(
                [
                    helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                    helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                    helper.make_attribute("kv_cache_bit_width", 8),
                ]
            )
            new_nodes.append(node)
    del g.node[:]
    g.node.extend(new_nodes)


def compact_folder_graph(folder: Path, kv_dtype: str, tokens: list[int] | None, granularity: str) -> dict[str, Any]:
    """Rewrite the finished folder's graph (graph.file) to a `kv_dtype` cache, in place (a new file renamed over
    the old one: a hard link to the old file keeps the fp32-cache graph). int8 calibrates on `tokens`. Returns
    the manifest's graph fields to update."""
    from gpt2edge.manifest import load_manifest
    from gpt2edge.onnx_io.stream import external_locations, load_graph
    from gpt2edge.quantize.graph import save_model

    graph = dict(load_manifest(folder).raw["graph"])
    path = Path(folder) / graph["file"]
    model = load_graph(path)
    shared = any(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    scales = calibrate(path, tokens, granularity, shared) if kv_dtype == "int8" else None
    rewrite(model, kv_dtype, scales)
    part = path.with_name(path.name + ".kvpart")
    locations = external_locations(model)
    if locations and path.name not in locations:  # weights in their own data file: the graph's nodes only
        onnx.save_model(model, str(part))
        os.replace(part, path)
    else:  # weights inside the graph file (read from the old file as the new one is written)
        files = save_model(model, part, base_dir=path.parent)
        if files != [part.name]:  # only a graph past 2 GB gets a data file, and such a graph keeps its own
            raise QuantizeError(f"{path}: the rewritten graph would not fit in one file; re-export the model.")
        os.replace(part, path)
    graph["kv_dtype"] = kv_dtype
    for io in ("inputs", "outputs"):
        graph[io] = [
            {**t, "dtype": kv_dtype} if t["name"].startswith((_PAST, _PRESENT)) else t for t in graph.get(io, [])
        ]
    if kv_dtype == "int8":
        graph["kv_quantization"] = {
            "scales": f"static symmetric, {granularity} (1 x n_head x 1 x head_dim per key/value tensor)",
            "granularity": granularity,
            "calibration_tokens": len(tokens),
            "calibration_text": "built-in sample",
        }
    return graph


def twin_folder(folder: Path) -> Path:
    """A hard-linked copy of a finished folder beside it (its fp32-cache graph, for the KV effect): no bytes are
    copied; the rewrite replaces the graph file by a new one, so the link keeps the old."""
    folder = Path(folder)
    twin = folder.with_name(f".{folder.name}.fp32kv")
    shutil.rmtree(twin, ignore_errors=True)
    for p in sorted(folder.rglob("*")):
        dst = twin / p.relative_to(folder)
        if p.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(p, dst)
        except OSError:  # a filesystem without hard links
            shutil.copy2(p, dst)
    return twin


def calibration_tokens(folder: Path) -> list[int]:
    """The calibration prefill: the built-in sample text in the folder's tokenizer, up to CALIBRATION_TOKENS
    and the model's positions."""
    from gpt2edge.runtime.model.folder import ModelFolder
    from gpt2edge.runtime.model.tokenizer import TextTokenizer
    from gpt2edge.sample_text import SAMPLE_TEXT

    f = ModelFolder.open(folder, verify=False)
    ids = TextTokenizer(f.tokenizer_path, f.dims.vocab_size).encode(SAMPLE_TEXT)
    return ids[: min(CALIBRATION_TOKENS, f.n_positions)]


def compact_kv_cache(
    folder: Path,
    manifest: dict[str, Any],
    kv_dtype: str,
    *,
    report: bool = True,
    text: str | None = None,
    text_source: str | None = None,
    log=None,
    granularity: str = DEFAULT_GRANULARITY,
) -> dict[str, Any]:
    """Rewrite a finished folder (its manifest written) to a `kv_dtype` cache and write its manifest again; with
    `report`, the KV effect (the quality report of this folder against itself with a float32 cache, on `text`
    or the built-in sample) goes to the manifest's kv_effect and, printed, to `log`. Returns the manifest."""
    from gpt2edge.manifest import write_manifest
    from gpt2edge.quality import compare_folders, print_report
    from gpt2edge.report_text import BUILT_IN

    folder = Path(folder)
    twin = twin_folder(folder) if report else None
    try:
        tokens = calibration_tokens(folder) if kv_dtype == "int8" else None
        manifest = {**manifest, "graph": compact_folder_graph(folder, kv_dtype, tokens, granularity)}
        manifest = write_manifest(folder, manifest)
        if twin is not None:
            effect = compare_folders(twin, folder, text=text, variant_name=f"{folder.name} ({kv_dtype} KV cache)")
            effect.update(reference="the same graph with a float32 KV cache", kv_dtype=kv_dtype)
            effect["text_scored"] = text_source or ("--text" if text is not None else BUILT_IN)
            for key in ("size_reference", "size_variant", "precision_reference"):
                effect.pop(key, None)
            manifest["kv_effect"] = effect
            if log is not None:
                print_report(effect, title=f"KV cache {kv_dtype} vs float32 (same weights)", file=log)
            manifest = write_manifest(folder, manifest)
    finally:
        if twin is not None:
            shutil.rmtree(twin, ignore_errors=True)
    return manifest

"""An export folder in onnxruntime-genai's form: genai_config.json, tokenizer_config.json, and a graph whose
`logits` output has the rank genai binds.

genai reads logits as (batch, seq, vocab); a `--head last` export returns next-token log-probs (batch, vocab),
which genai refuses ("Invalid rank for output: logprobs"). One Unsqueeze gives a `logits` output
(batch, 1, vocab), which genai treats as a last-position-only head; every other node is the export's. The values
are log-probs, i.e. logits minus a per-row constant: greedy, temperature, top-k and top-p pick the same tokens,
and genai's repetition penalty acts on them as gpt2edge's sampler does. A `--head all` export's (batch, seq,
vocab) output is bound as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpt2edge.errors import ConvertError

GENAI_CONFIG = "genai_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
LOGPROBS = "logprobs"
LOGITS = "logits"
_AXES = "gpt2edge_logits_axes"


def graph_head(model) -> str:
    """The head the graph really has, read from its structure (never from the manifest): "tail" when it takes
    a logits_to_keep input, else "last" for a (B, V) `logprobs` output and "all" for a (B, S, V) one."""
    from gpt2edge.manifest.records import KEEP_INPUT

    g = model.graph
    if KEEP_INPUT in {i.name for i in g.input}:
        return "tail"
    out = next((o for o in g.output if o.name == LOGPROBS), None)
    if out is None:
        names = ", ".join(o.name for o in g.output)
        raise ConvertError(f"The graph has no '{LOGPROBS}' output (outputs: {names}); re-export the model.")
    rank = len(out.type.tensor_type.shape.dim)
    if rank not in (2, 3):
        raise ConvertError(f"The graph's '{LOGPROBS}' output has rank {rank}, not 2 or 3; re-export the model.")
    return "last" if rank == 2 else "all"


def check_graph_head(model, recorded: str, src: Path) -> None:
    """Refuse a folder whose manifest records another head than its graph has: genai would be configured for
    the wrong output rank and fail only when run."""
    real = graph_head(model)
    if real != recorded:
        raise ConvertError(
            f"{src}: the manifest records --head {recorded} but the graph is a --head {real} graph (its "
            f"'{LOGPROBS}' output and inputs say so); the folder was edited or mixed up, export it again."
        )


def add_logits_output(model) -> dict[str, Any]:
    """Replace the (B, V) `logprobs` output of `model` (onnx.ModelProto, edited in place) by
    `logits` = Unsqueeze(logprobs, 1): (B, 1, V). Returns the new output's manifest entry."""
    from onnx import TensorProto, helper

    g = model.graph
    names = [o.name for o in g.output]
    if LOGPROBS not in names:
        raise ConvertError(f"The graph has no '{LOGPROBS}' output (outputs: {', '.join(names)}); re-export the model.")
    taken = {n for node in g.node for n in node.output} | {i.name for i in g.input} | {i.name for i in g.initializer}
    if LOGITS in taken or _AXES in taken:
        raise ConvertError(f"The graph already has a tensor named '{LOGITS}' or '{_AXES}'; re-export the model.")
    i = names.index(LOGPROBS)
    old = g.output[i]
    dims = [d.dim_param or d.dim_value for d in old.type.tensor_type.shape.dim]  # (B, V)
    g.initializer.append(helper.make_tensor(_AXES, TensorProto.INT64, [1], [1]))
    g.node.append(helper.make_node("Unsqueeze", [LOGPROBS, _AXES], [LOGITS], name="gpt2edge_logits"))
    new = helper.make_tensor_value_info(LOGITS, old.type.tensor_type.elem_type, [dims[0], 1, dims[1]])
    g.output.remove(old)
    g.output.insert(i, new)  # the presents keep their places after it
    dtype = helper.tensor_dtype_to_np_dtype(old.type.tensor_type.elem_type).name
    return {"name": LOGITS, "dtype": dtype, "shape": [dims[0], 1, dims[1]]}


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def genai_config(
    manifest: dict[str, Any], generation: dict[str, Any], logits_name: str, graph_file: str
) -> dict[str, Any]:
    """genai_config.json for the folder: model type "decoder" (genai's generic decoder-only model) with the
    export's own input/output names, search defaults from generation_config.json (transformers' otherwise)."""
    d = manifest["dims"]
    eos = _token_ids(generation.get("eos_token_id")) or [d["vocab_size"] - 1]
    bos = _token_ids(generation.get("bos_token_id")) or eos[:1]
    pad = _token_ids(generation.get("pad_token_id")) or eos[:1]
    shared = manifest["graph"].get("kv_cache", "concat") == "shared"
    return {
        "model": {
            "type": "decoder",
            "bos_token_id": bos[0],
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": pad[0],
            "context_length": d["n_positions"],
            "vocab_size": d["vocab_size"],
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": graph_file,
                "head_size": d["head_dim"],
                "hidden_size": d["n_embd"],
                "num_attention_heads": d["n_head"],
                "num_key_value_heads": d["n_head"],
                "num_hidden_layers": d["n_layer"],
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": logits_name,
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "max_length": d["n_positions"],
            "min_length": 0,
            # the shared graph updates its (B, nh, max_length, hs) cache in place, as genai's shared buffer does
            "past_present_share_buffer": shared,
            "do_sample": bool(generation.get("do_sample", False)),
            "temperature": float(generation.get("temperature", 1.0)),
            "top_k": int(generation.get("top_k", 50)),
            "top_p": float(generation.get("top_p", 1.0)),
            "repetition_penalty": float(generation.get("repetition_penalty", 1.0)),
            "num_beams": 1,
            "num_return_sequences": 1,
        },
    }


def tokenizer_config(tokenizer_json: Path, generation: dict[str, Any], n_positions: int) -> dict[str, Any]:
    """genai's tokenizer reads tokenizer.json plus this file (the class and the special tokens by text)."""
    from gpt2edge.runtime.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_json)
    eos_ids = _token_ids(generation.get("eos_token_id"))  # id 0 is a valid id: test for presence, not truth
    eos = tok.id_to_token(eos_ids[0]) if eos_ids else None
    if eos is None:
        raise ConvertError(f"{tokenizer_json} has no end-of-text token for generation_config's eos_token_id.")
    bos_id = _token_ids(generation.get("bos_token_id"))
    return {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": tok.id_to_token(bos_id[0]) if bos_id else eos,
        "eos_token": eos,
        "unk_token": eos,
        "add_prefix_space": False,
        "model_max_length": n_positions,
    }

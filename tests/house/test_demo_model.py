"""The quickstart's shipped model (models/gpt2-stdlib-mini, scripts/train_demo_model.py): the folder is in the
repository at a size that suits a clone, is a checkpoint transformers loads with its own GPT-2 tokenizer, and
writes Python-looking text, not the gibberish of random weights."""

from __future__ import annotations

import json
import keyword
import re
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[2] / "models" / "gpt2-stdlib-mini"
PROMPT = "import os\nimport sys\n\n\ndef"


def test_the_folder_is_a_small_fp16_checkpoint_with_its_tokenizer():
    names = {p.name for p in MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "README.md"} <= names
    config = json.loads((MODEL / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["vocab_size"] == 50257
    assert sum(p.stat().st_size for p in MODEL.iterdir()) < 20e6  # a size that suits a clone
    from safetensors import safe_open

    with safe_open(str(MODEL / "model.safetensors"), "np") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F16"}
    # the README states the losses the training run recorded
    record = json.loads((MODEL / "training.json").read_text())
    readme = (MODEL / "README.md").read_text()
    assert f"{record['final_held_out_loss']:.2f}" in readme and record["final_held_out_loss"] < 5.0


@pytest.fixture(scope="module")
def greedy_text() -> str:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2LMHeadModel

    tok = Tokenizer(models.BPE.from_file(str(MODEL / "vocab.json"), str(MODEL / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    assert tok.encode("Hello world").ids == [15496, 995]  # GPT-2's BPE, not another vocabulary
    model = GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(PROMPT).ids])
    with torch.no_grad():
        # greedy, with the repetition penalty that keeps it off runs of indentation spaces (the model's README)
        out = model.generate(ids, max_new_tokens=48, do_sample=False, repetition_penalty=1.3, pad_token_id=50256)
    return tok.decode(out[0, ids.shape[1] :].tolist())


def test_greedy_output_is_python_looking_text(greedy_text):
    text = greedy_text
    printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text)
    assert printable / max(1, len(text)) > 0.95, text
    words = set(re.findall(r"[A-Za-z_]+", text))
    assert words & set(keyword.kwlist) - {"def"} or "self" in words, text  # a keyword beyond the prompt's
    assert len(text.split()) >= 5, text  # words, not only indentation

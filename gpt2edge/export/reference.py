"""The PyTorch source as the reference of a quality report (`gpt2edge parity MODEL_DIR -m SOURCE`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2edge.export.checkpoint import load_checkpoint
from gpt2edge.quality import DEFAULT_MAX_TOKENS, GREEDY_PROMPT_TOKENS, compare, folder_side


def compare_with_source(
    model_dir: Path, source: str, text: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS
) -> dict[str, Any]:
    """Report for an export folder against the transformers model it came from."""
    tokens, lp_var, greedy_var, folder = folder_side(Path(model_dir), None, text, max_tokens)
    hf = load_checkpoint(source).model
    with torch.no_grad():
        ids = torch.tensor([tokens])
        lp_ref = torch.log_softmax(hf(ids).logits[0].float(), -1).numpy()
        # plain argmax loop (no EOS handling), exactly what the runtime's greedy continuation does
        seq = ids[:, :GREEDY_PROMPT_TOKENS]
        for _ in range(len(greedy_var)):
            nxt = hf(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    greedy_ref = seq[0, GREEDY_PROMPT_TOKENS:].tolist()
    report = compare(np.asarray(lp_ref), lp_var, tokens, greedy_ref, greedy_var)
    report.update(reference=f"{source} (PyTorch)", variant=str(model_dir), precision_variant=folder.precision)
    return report

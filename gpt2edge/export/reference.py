"""The PyTorch source as the reference of a quality report (`gpt2edge parity MODEL_DIR -m SOURCE`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge.errors import ModelFolderError
from gpt2edge.export.checkpoint import load_checkpoint
from gpt2edge.extras import require_extra
from gpt2edge.manifest import load_manifest
from gpt2edge.quality import COMPARABLE_DIMS, DEFAULT_MAX_TOKENS, check_report_text, compare, folder_side


def compare_with_source(
    model_dir: Path, source: str, text: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS
) -> dict[str, Any]:
    """Report for an export folder against the transformers model it came from."""
    require_extra("export", "parity -m")
    import torch

    dims = load_manifest(model_dir).dims
    check_report_text(model_dir, text, max_tokens)
    hf = load_checkpoint(source).model
    for key in COMPARABLE_DIMS:  # before the (token by token) stream runs
        if getattr(hf.config, key) != dims[key]:
            raise ModelFolderError(
                f"{model_dir} is not an export of {source}: {key} {dims[key]} vs {getattr(hf.config, key)}."
            )
    tokens, lp_var, greedy_var, starts, folder = folder_side(Path(model_dir), None, text, max_tokens)
    greedy_ref = []
    with torch.no_grad():
        ids = torch.tensor([tokens])
        lp_ref = torch.log_softmax(hf(ids).logits[0].float(), -1).numpy()
        # plain cached argmax loops (no EOS handling), exactly what the runtime's greedy continuations do
        for start, continuation in zip(starts, greedy_var):
            out = hf(ids[:, :start], use_cache=True)
            new = [int(out.logits[0, -1].argmax())]
            while len(new) < len(continuation):
                cache = getattr(out, "cache", None) or out.past_key_values  # renamed in transformers 5.x
                out = hf(torch.tensor([[new[-1]]]), cache, use_cache=True)
                new.append(int(out.logits[0, -1].argmax()))
            greedy_ref.append(new)
    report = compare(np.asarray(lp_ref), lp_var, tokens, greedy_ref, greedy_var, starts)
    report.update(reference=f"{source} (PyTorch)", variant=str(model_dir), precision_variant=folder.precision)
    return report

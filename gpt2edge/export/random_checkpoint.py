"""Seeded random-weight GPT-2 checkpoints, saved as ordinary HF folders: for tests, demos and benchmarks.

No model can be downloaded here, so the offline default model is built from a GPT2Config. Its weights are
random: it exercises every code path and has the real shape, but its text is gibberish.
"""

from __future__ import annotations

from pathlib import Path

from gpt2edge.api_args import path_arg
from gpt2edge.budget.needs import check_need, checkpoint_need, n_parameters
from gpt2edge.errors import CheckpointError
from gpt2edge.export.tokenizer_source import check_tokenizer_folder
from gpt2edge.folder import atomic_output_dir
from gpt2edge.folder.checks import is_checkpoint_folder
from gpt2edge.sample_text import SAMPLE_TEXT

EOS = "<|endoftext|>"
# name -> GPT2Config overrides; "small" is the real 124M GPT-2 shape (vocab from the tokenizer).
# tiny/mini use a wider weight init than GPT-2's 0.02: at 0.02 a small random model's next-token
# distribution is nearly uniform, and quality reports (KL, top-1) could not tell a broken quantizer apart.
SIZES = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, n_positions=128, initializer_range=0.2),
    "mini": dict(n_layer=4, n_head=4, n_embd=128, n_positions=256, initializer_range=0.2),
    "small": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257),
    # the other official shapes (gpt2-medium, -large, -xl): 355M, 774M and 1.5B parameters
    "medium": dict(n_layer=24, n_head=16, n_embd=1024, n_positions=1024, vocab_size=50257),
    "large": dict(n_layer=36, n_head=20, n_embd=1280, n_positions=1024, vocab_size=50257),
    "xl": dict(n_layer=48, n_head=25, n_embd=1600, n_positions=1024, vocab_size=50257),
}


def train_tokenizer(vocab_size: int = 400, text: str = SAMPLE_TEXT):
    """A byte-level BPE tokenizer trained in-process (GPT-2's scheme), wrapped as a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(text.splitlines(), vocab_size=vocab_size, min_frequency=1, special_tokens=[EOS])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS, unk_token=EOS)


def make_random_checkpoint(
    out: Path, size: str = "tiny", seed: int = 0, tokenizer_dir: str | None = None, force: bool = False
) -> Path:
    """Write a random-weight GPT2LMHeadModel + tokenizer to `out` (atomically); returns `out`."""
    out = path_arg(out, "out")  # a TypeError names a wrong type, before torch is imported
    if tokenizer_dir is not None:  # a local folder only: a missing one or one with no tokenizer files, refused now
        check_tokenizer_folder(tokenizer_dir)
    import torch
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

    from gpt2edge.export.checkpoint import _quiet_transformers, load_tokenizer

    if size not in SIZES:
        raise CheckpointError(f"Unknown size '{size}'; choose one of {', '.join(SIZES)}.")
    # without a tokenizer folder, a small one is trained here; "small" keeps GPT-2's 50,257-row embedding
    # either way (ids past the trained vocabulary decode to nothing), so sizes and speed stay GPT-2's
    tokenizer = (
        load_tokenizer(str(tokenizer_dir), local_files_only=True) if tokenizer_dir is not None else train_tokenizer()
    )
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    if not isinstance(eos_id, int) or tokenizer.convert_ids_to_tokens(eos_id) != EOS:
        raise CheckpointError(f"The tokenizer has no {EOS} token; use a GPT-2 byte-level BPE tokenizer.")
    shape = dict(SIZES[size])
    vocab_size = max(len(tokenizer), shape.pop("vocab_size", 0))
    check_need(checkpoint_need(4 * n_parameters({**shape, "vocab_size": vocab_size})), Path(out))
    config = GPT2Config(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, **shape)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    with (
        atomic_output_dir(Path(out), force=force, sources=[tokenizer_dir], kind=is_checkpoint_folder) as tmp,
        _quiet_transformers(),  # its "Writing model shards" bar on a terminal only
    ):
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, do_sample=False).save_pretrained(tmp)
    return Path(out)

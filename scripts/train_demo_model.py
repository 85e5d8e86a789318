"""Train the quickstart's demo model: a small GPT-2 on CPython's standard library, with the real GPT-2 BPE.

    python scripts/train_demo_model.py --tokenizer DIR [--out models/gpt2-stdlib-mini] [--steps 2000]

DIR holds GPT-2's `vocab.json` and `merges.txt` (OpenAI's public files; every Hugging Face `gpt2` folder has
them). The corpus is every `.py` file under the running Python's standard-library folder (no site-packages, no
test suites), read in sorted order; one file in 50 (by sorted index) is held out. Seeded throughout: the same
Python version, torch version and thread count give the same weights. Writes an fp16 `model.safetensors`,
`config.json`, the tokenizer files and `train_log.tsv` (step, learning rate, train loss, held-out loss).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel

EOT = 50256
SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def corpus_files(root: Path) -> list[Path]:
    """The standard library's own .py files, sorted; test suites and installed packages left out."""
    files = [p for p in root.rglob("*.py") if not SKIP_PARTS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def gpt2_tokenizer(folder: Path) -> Tokenizer:
    """GPT-2's byte-level BPE from its two public files, as transformers' GPT2TokenizerFast builds it."""
    tok = Tokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def encode(tok: Tokenizer, files: list[Path]) -> np.ndarray:
    """All files' tokens, each file followed by <|endoftext|> (as GPT-2's training documents are joined)."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    out: list[int] = []
    for enc in tok.encode_batch(texts):
        out.extend(enc.ids)
        out.append(EOT)
    return np.asarray(out, dtype=np.int32)


def batch(data: np.ndarray, starts: np.ndarray, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of windows starting at `starts`."""
    x = np.stack([data[s : s + ctx] for s in starts]).astype(np.int64)
    y = np.stack([data[s + 1 : s + 1 + ctx] for s in starts]).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


@torch.no_grad()
def held_out_loss(model: GPT2LMHeadModel, data: np.ndarray, ctx: int, n: int = 32) -> float:
    """Mean next-token loss over `n` evenly spaced held-out windows (the same windows every time)."""
    model.eval()
    starts = np.linspace(0, len(data) - ctx - 2, n).astype(np.int64)
    losses = []
    for i in range(0, n, 8):
        x, y = batch(data, starts[i : i + 8], ctx)
        logits = model(input_ids=x).logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    model.train()
    return float(np.mean(losses))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with GPT-2's vocab.json and merges.txt")
    ap.add_argument("--out", type=Path, default=Path("models/gpt2-stdlib-mini"))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    args = ap.parse_args()

    # seeded everywhere, a fixed thread count: the run is reproducible on the same software
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)

    # the corpus: the stdlib's files in sorted order, every 50th held out (a split by file, never by window)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files(root)
    held = [p for i, p in enumerate(files) if i % 50 == 0]
    train_files = [p for i, p in enumerate(files) if i % 50 != 0]
    tok = gpt2_tokenizer(args.tokenizer)
    train, val = encode(tok, train_files), encode(tok, held)
    digest = hashlib.sha256(train.tobytes() + val.tobytes()).hexdigest()[:16]
    print(
        f"corpus: {len(train_files)} train / {len(held)} held-out files from {root}, "
        f"{len(train):,} / {len(val):,} tokens, sha256[:16] {digest}",
        flush=True,
    )

    # a small GPT-2: no dropout (a short run on ~1 epoch does not overfit), tied LM head as GPT-2 has
    config = GPT2Config(
        vocab_size=50257,
        n_positions=args.ctx,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=EOT,
        eos_token_id=EOT,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 30)

    def lr_at(step: int) -> float:
        # linear warm-up, then cosine down to a tenth
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "train_log.tsv").open("w")
    log.write("step\tlr\ttrain_loss\theld_out_loss\n")
    t0, ema = time.time(), None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = batch(train, rng.integers(0, len(train) - args.ctx - 1, size=args.batch), args.ctx)
        # bf16 autocast: the CPU's AMX/AVX-512 bf16 units; the weights and the optimizer stay fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        last = step == args.steps - 1
        val_loss = held_out_loss(model, val, args.ctx) if (step + 1) % args.eval_every == 0 or last else float("nan")
        log.write(f"{step + 1}\t{lr_at(step):.6f}\t{loss.item():.4f}\t{val_loss:.4f}\n")
        log.flush()
        if (step + 1) % 50 == 0 or last:
            print(
                f"step {step + 1}/{args.steps} loss {ema:.3f} held-out {val_loss:.3f} "
                f"{(time.time() - t0) / (step + 1):.2f} s/step",
                flush=True,
            )

    # the folder `gpt2edge export -m` reads: fp16 safetensors (half the clone size), config, GPT-2's BPE files
    train_loss = held_out_loss(model, train, args.ctx, n=64)
    val_loss = held_out_loss(model, val, args.ctx, n=64)
    model.half().save_pretrained(args.out, safe_serialization=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(args.tokenizer / name, args.out / name)
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "add_prefix_space": False,
                "model_max_length": args.ctx,
            },
            indent=2,
        )
        + "\n"
    )
    (args.out / "training.json").write_text(
        json.dumps(
            {
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "steps": args.steps,
                "batch": args.batch,
                "ctx": args.ctx,
                "lr": args.lr,
                "seed": args.seed,
                "threads": args.threads,
                "train_files": len(train_files),
                "held_out_files": len(held),
                "train_tokens": int(len(train)),
                "held_out_tokens": int(len(val)),
                "corpus_sha256_16": digest,
                "final_train_loss": round(train_loss, 4),
                "final_held_out_loss": round(val_loss, 4),
                "minutes": round((time.time() - t0) / 60, 1),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"done: train loss {train_loss:.3f}, held-out loss {val_loss:.3f} -> {args.out}", flush=True)


if __name__ == "__main__":
    main()

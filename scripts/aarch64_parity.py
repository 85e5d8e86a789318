"""Greedy parity of folders made on x86 when they run on ARM (scripts/test-aarch64.sh; docs/arm.md, docs/parity.md).

    python scripts/aarch64_parity.py make DIR    on the x86 host (needs torch): a tiny seeded random GPT-2 exported
                                                 fp32, quantized int8 and int4 (built-in defaults and each ARM
                                                 target), and a sparse head; each folder's greedy ids and the gap
                                                 between its top-2 log-probs at every step, as run here
    python scripts/aarch64_parity.py check DIR   anywhere (torch-free runtime): the same generations compared
                                                 with the recorded ones; exits 1 on a difference the rule refuses

The rule: fp32, sparse and every int4 folder's ids equal the recorded ones, the ARM recipes' included (their
recipe keeps KleidiAI off, so MLAS's per-block int8 activations run them, as on x86). int8 ids equal them or first
differ at a step where the recorded top-2 gap is at most NEAR_TIE nats: int8-activation kernels on another CPU round
differently, which can swap two tokens whose log-probs are that close (docs/parity.md). So do the ARM recipes' int4
folders when GPT2EDGE_KLEIDIAI=1 turns KleidiAI back on (activations quantized per row: scripts/arm_int4_repro.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

PROMPT = "The quick brown fox"
NEW_TOKENS = 32
NEAR_TIE = 0.1  # nats between the top two log-probs (docs/parity.md, "ARM")
ARM_TARGETS = ("arm64", "arm64-dotprod", "arm64-i8mm", "arm64-sve")
RECORD = "x86.json"


def greedy(folder: Path) -> dict:
    """Greedy ids of PROMPT + NEW_TOKENS and the top-2 log-prob gap at each step, on the torch-free runtime."""
    from gpt2edge.runtime import Generator

    gen = Generator(folder, threads=1)
    res = gen.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, ignore_eos=True, logprobs=2)
    gaps = [step.top_logprobs[0].logprob - step.top_logprobs[1].logprob for step in res.logprobs]
    return {"ids": res.token_ids, "gaps": [round(g, 6) for g in gaps]}


def make(root: Path) -> None:
    """The folders and x86.json, in `root` (made fresh)."""
    from gpt2edge.export import export_model, make_random_checkpoint
    from gpt2edge.quantize import make_recipe, quantize_model
    from gpt2edge.sparse.handler import sparse_head

    root.mkdir(parents=True, exist_ok=True)
    ckpt = make_random_checkpoint(root / "checkpoint", size="tiny", seed=0, force=True)
    fp32 = root / "fp32"
    # no PyTorch check here: the lane compares ARM with x86's ONNX Runtime (the test suite checks export itself),
    # and the tiny model's fp32 log-probs have landed just past 1e-4 of PyTorch's on a loaded host
    export_model(str(ckpt), fp32, force=True, run_validation=False)
    folders = {"fp32": fp32}
    # the built-in defaults, then each ARM target's recipe: a folder made for one CPU must run right on every other
    for target in (None, *ARM_TARGETS):
        for mode in ("int8", "int4"):
            name = mode if target is None else f"{mode}-{target}"
            quantize_model(fp32, root / name, make_recipe(mode, target=target), force=True, report=False, log=None)
            folders[name] = root / name
    sparse_head(fp32, root / "sparse", rank=4, candidates_k=32, force=True, log=open(os.devnull, "w"))
    folders["sparse"] = root / "sparse"
    record = {name: greedy(path) for name, path in folders.items()}
    (root / RECORD).write_text(json.dumps(record, indent=1))
    print(f"aarch64_parity: {len(record)} folders and their x86 greedy ids in {root}")


def near_tie_allowed(manifest: dict, env: dict | None = None) -> bool:
    """Whether a folder's int8-activation kernels may differ from x86's at a near-tie (the rule above): int8, and an
    ARM recipe's int4 at level 4 only where KleidiAI runs it (a recipe without kleidiai: false, or
    GPT2EDGE_KLEIDIAI=1)."""
    env = os.environ if env is None else env
    recipe = (manifest.get("quantization") or {}).get("recipe") or {}
    if recipe.get("mode") == "int8":
        return True
    kleidiai = recipe.get("kleidiai") is not False or env.get("GPT2EDGE_KLEIDIAI") == "1"
    return recipe.get("target") in ARM_TARGETS and recipe.get("accuracy_level") == 4 and kleidiai


def verdict(name: str, want: dict, got: list[int], tolerant: bool) -> tuple[bool, str]:
    """(passes, what happened) for one folder: equal, or where it differs and whether that is a near-tie."""
    first = next((i for i, (a, b) in enumerate(zip(want["ids"], got)) if a != b), None)
    if first is None and len(got) == len(want["ids"]):
        return True, "equal"
    first = min(len(got), len(want["ids"])) if first is None else first
    step = first - (len(want["ids"]) - len(want["gaps"]))  # the step that generated id `first`
    gap = want["gaps"][step] if 0 <= step < len(want["gaps"]) else float("inf")
    near = gap <= NEAR_TIE
    if tolerant and near:
        return True, f"near-tie: differs from step {step} (x86 top-2 gap {gap:.3f} nats)"
    return False, f"DIFFERS from step {step} (x86 top-2 gap {gap:.3f} nats)"


def check(root: Path) -> int:
    """Compare every recorded folder's greedy run here; 0 when the rule holds for all."""
    from gpt2edge.cpu_facts import this_cpu

    record = json.loads((root / RECORD).read_text())
    cpu = os.environ.get("GPT2EDGE_LANE_CPU") or this_cpu().name
    failed = 0
    for name, want in record.items():
        got = greedy(root / name)
        manifest = json.loads((root / name / "manifest.json").read_text())
        ok, what = verdict(name, want, got["ids"], near_tie_allowed(manifest))
        failed += not ok
        print(f"| {cpu} | {name} | {what} |", flush=True)
    print(f"aarch64_parity on {cpu} ({this_cpu().name}):")
    print(f"parity: {len(record) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("make", "check"))
    ap.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    if args.action == "make":
        make(args.dir)
        return 0
    return check(args.dir)


if __name__ == "__main__":
    sys.exit(main())

"""Peak RSS of each phase of `gpt2edge quantize` with its quality report, in one process: /proc/self/status
when each phase ends, the peak (VmHWM) reset between phases through /proc/self/clear_refs (Linux).

    python benchmarks/quantize_phases.py MODEL_DIR OUT --mode int8|int4|fp16

Phases: the rewrite, writing the folder, handing the freed heap back, then for each side of the report (the
fp32 parent, then the variant) its session, each greedy run and the streamed log-probs, and the metrics.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_phases import mark  # noqa: E402  (benchmarks/ is not a package)


def wrap(module, name: str) -> None:
    """Mark the phase before module.name (what ran since the last mark) and its own when it returns."""
    f = getattr(module, name)

    @functools.wraps(f)
    def marked(*a, **k):
        mark(f"before {name}")
        result = f(*a, **k)
        mark(name)
        return result

    setattr(module, name, marked)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--mode", choices=["int8", "int4", "fp16"], required=True)
    args = ap.parse_args()
    import gpt2edge.cli  # noqa: F401  (what the command imports)
    import gpt2edge.quality as quality
    import gpt2edge.quantize.graph as graph
    import gpt2edge.quantize.handler as handler
    from gpt2edge.quantize import make_recipe, quantize_model

    mark("imports")
    wrap(graph, "write_variant")
    wrap(handler, "return_free_memory")
    for name in ("load_graph", "greedy_continuation", "stream_logprobs", "compare"):
        wrap(quality, name)
    shutil.rmtree(args.out, ignore_errors=True)
    quantize_model(args.model_dir, args.out, make_recipe(args.mode), log=None)
    mark("end")
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()

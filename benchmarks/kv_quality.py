"""The KV effect on trained-gpt2-py with fp32 weights: each graph kind exported, copies rewritten to an fp16 cache
and to int8 at three scale granularities, each scored against its export on held-out Python source.

    python benchmarks/kv_quality.py [ROOT]
"""

import shutil
import sys
from pathlib import Path

from gpt2edge.export import export_model
from gpt2edge.manifest import load_manifest, write_manifest
from gpt2edge.quality import compare_folders
from gpt2edge.quantize.kv import calibration_tokens, compact_folder_graph

root = Path(sys.argv[1] if len(sys.argv) > 1 else "out/kv-quality")
root.mkdir(parents=True, exist_ok=True)
t = Path("gpt2edge/runtime/model/kv_cache.py").read_text()
held = t[t.index("from __future__") :]
for kind in ("concat", "shared"):
    src = root / kind
    if not src.exists():
        export_model(
            str(Path(__file__).resolve().parents[2] / "shared" / "trained-gpt2-py"), src, kv_cache=kind, log=None
        )
    tok = calibration_tokens(src)
    for dt, gran in (("float16", None), ("int8", "per-channel"), ("int8", "per-head"), ("int8", "per-tensor")):
        dst = root / f"{kind}-{dt}-{gran}"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        g = compact_folder_graph(dst, dt, tok, gran or "per-channel")
        m = dict(load_manifest(dst).raw)
        m["graph"] = g
        write_manifest(dst, m)
        r = compare_folders(src, dst, text=held)
        print(
            f"{kind} {dt} {gran} calibration {len(tok)} tokens: KL {r['mean_kl']:.3e} top1 {r['top1_agreement']:.4f} "
            f"maxd {r['max_abs_logprob_diff']:.3f} greedy {r['greedy_match']}/{r['greedy_tokens']} "
            f"ppl {r['perplexity_reference']:.3f}/{r['perplexity_variant']:.3f}",
            flush=True,
        )

"""gpt2edge's page against transformers.js in the same headless Chromium (WASM, same threads), same weights.

    python benchmarks/web_vs_transformersjs.py [--checkpoint DIR ...] [--rounds 3] [--threads 2]
        [--prompt-tokens 128] [--new-tokens 128] [--work /tmp/web-bench] [--optimum-cli PATH]

For each checkpoint: gpt2edge export -> (fp32 concat, fp32 shared, int8 shared, int4 shared) -> convert
--format web; and an Optimum-style folder for transformers.js (config, tokenizer, onnx/model.onnx with
`logits` of every position and past/present, onnx/model_quantized.onnx = q8 by onnxruntime's
quantize_dynamic as transformers.js' own script makes it, onnx/model_q4.onnx = q4 by MatMulNBitsQuantizer,
block 32 symmetric). With --optimum-cli the fp32 graph comes from `optimum-cli export onnx`; without it, from
gpt2edge's `--head all --kv-cache concat` export with the LogSoftmax removed (the same IO contract: logits
of every position, concatenating cache). Greedy, EOS ignored; the configurations run in interleaved rounds
(rotated order), each page load a fresh tab. Prints one table row per (checkpoint, runtime, precision) with
medians and ranges, and the per-round transformers.js / gpt2edge ratio of decode ms/token.
Install the transformers.js side first: (cd web/bench && npm ci --ignore-scripts).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import urllib.parse
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from web_helpers import WEB, StaticServer, job_url, run_browser  # noqa: E402

KINDS = ("concat", "shared")  # gpt2edge's two KV-cache graphs: folder f"{precision}-{kind}"
TJS = {"fp32": "fp32", "int8": "q8", "int4": "q4"}


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def gpt2edge_folders(ckpt: Path, name: str, work: Path, root: Path) -> None:
    g = str(REPO / ".venv" / "bin" / "gpt2edge")
    exp = work / name
    for kind in ("concat", "shared"):
        if not (exp / f"fp32-{kind}").exists():
            sh(g, "export", "-m", str(ckpt), str(exp / f"fp32-{kind}"), "--kv-cache", kind, "--no-validate")
    for mode in ("int8", "int4"):
        for kind in KINDS:
            if not (exp / f"{mode}-{kind}").exists():
                sh(g, "quantize", str(exp / f"fp32-{kind}"), "-o", str(exp / f"{mode}-{kind}"), "--mode", mode,
                   "--no-report")
    for v in (f"{p}-{k}" for p in ("fp32", "int8", "int4") for k in KINDS):
        if not (root / "g" / name / v).exists():
            sh(g, "convert", str(exp / v), "-o", str(root / "g" / name / v), "--format", "web")


def tjs_folder(ckpt: Path, name: str, work: Path, root: Path, optimum_cli: str | None) -> None:
    import onnx

    out = root / "tjs" / name
    if (out / "onnx" / "model_q4.onnx").exists():
        return
    (out / "onnx").mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (ckpt / f).exists():
            shutil.copy(ckpt / f, out / f)
    if optimum_cli:
        opt = work / name / "optimum"
        sh(optimum_cli, "export", "onnx", "-m", str(ckpt), "--task", "text-generation-with-past", str(opt))
        shutil.copy(opt / "model.onnx", out / "onnx" / "model.onnx")
    else:
        exp = work / name / "fp32-all"
        if not exp.exists():
            sh(str(REPO / ".venv" / "bin" / "gpt2edge"), "export", "-m", str(ckpt), str(exp), "--head", "all",
               "--no-validate")  # fmt: skip
        m = onnx.load(str(exp / "model.onnx"))
        node = next(n for n in m.graph.node if n.op_type == "LogSoftmax")
        logits_in = node.input[0]
        m.graph.node.remove(node)
        for o in m.graph.output:
            if o.name == "logprobs":
                o.name = logits_in
        for n in m.graph.node:  # the tensor before the LogSoftmax becomes the `logits` output
            n.output[:] = ["logits" if x == logits_in else x for x in n.output]
            n.input[:] = ["logits" if x == logits_in else x for x in n.input]
        for o in m.graph.output:
            if o.name == logits_in:
                o.name = "logits"
        onnx.save(m, str(out / "onnx" / "model.onnx"))
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantize_dynamic(str(out / "onnx" / "model.onnx"), str(out / "onnx" / "model_quantized.onnx"),
                     weight_type=QuantType.QUInt8)  # fmt: skip
    q4 = MatMulNBitsQuantizer(onnx.load(str(out / "onnx" / "model.onnx")), block_size=32, is_symmetric=True)
    q4.process()
    q4.model.save_model_to_file(str(out / "onnx" / "model_q4.onnx"), use_external_data_format=False)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", action="append", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path("/tmp/web-bench"))
    ap.add_argument("--optimum-cli", default=None)
    ap.add_argument("--precisions", default="fp32,int8,int4")
    args = ap.parse_args()
    ckpts = args.checkpoint or [Path("/work/peers/ckpt"), Path("/work/shared/trained-gpt2-py")]
    if not (WEB / "bench" / "node_modules" / "@huggingface" / "transformers").is_dir():
        sys.exit("error: transformers.js is not installed; run (cd web/bench && npm ci --ignore-scripts) first.")
    root = args.work / "root"
    root.mkdir(parents=True, exist_ok=True)
    for link, target in [("node_modules", WEB / "bench" / "node_modules"),
                         ("tjs-vendor", WEB / "bench" / "node_modules" / "onnxruntime-web" / "dist")]:  # fmt: skip
        if not (root / link).exists():
            os.symlink(target, root / link)
    shutil.copy(WEB / "bench" / "tjs.html", root / "tjs.html")
    names = []
    for ckpt in ckpts:
        name = ckpt.name
        names.append(name)
        gpt2edge_folders(ckpt, name, args.work, root)
        tjs_folder(ckpt, name, args.work, root, args.optimum_cli)
    prompt = " hello" * args.prompt_tokens  # one GPT-2 token per " hello"
    common = {"max_new_tokens": args.new_tokens, "threads": args.threads}
    configs = []  # (checkpoint, runtime, precision): runtime "gpt2edge concat", "gpt2edge shared", "transformers.js"
    for name in names:
        for p in args.precisions.split(","):
            configs += [(name, f"gpt2edge {k}", p) for k in KINDS] + [(name, "transformers.js", p)]
    results: dict[tuple, list[dict]] = {c: [] for c in configs}

    def one_round(r: int, server: StaticServer) -> None:
        order = configs[r % len(configs):] + configs[: r % len(configs)]  # rotated: no config always first
        urls = []
        for c in order:
            name, runtime, p = c
            report = f"/report/{r}/{'/'.join(c)}".replace(" ", "-")  # a URL path as the server sees it
            if runtime.startswith("gpt2edge"):
                folder = f"{p}-{runtime.split()[1]}"
                urls.append(job_url(f"{server.url}g/{name}/{folder}/", report, prompt, temperature=0,
                                    ignore_eos=1, device="wasm", **common))  # fmt: skip
            else:
                q = {"model": name, "dtype": TJS[p], "prompt": prompt, "report": report, **common}
                urls.append(f"{server.url}tjs.html?{urllib.parse.urlencode(q)}")
        run_browser(urls, timeout_s=900)
        for c in order:
            got = server.reports.get(f"/report/{r}/{'/'.join(c)}".replace(" ", "-"), [{"error": "no report"}])[0]
            results[c].append(got)
            print(f"round {r} {c}: " + (got.get("error") or f"prefill {got['prefill_ms']:.0f} ms, "
                  f"decode {got['decode_ms_per_token']:.2f} ms/token"), file=sys.stderr, flush=True)  # fmt: skip

    with StaticServer(root) as server:
        for r in range(args.rounds):
            with open("/tmp/bench.lock", "a") as lock:  # one timing run on the host at a time (other helpers too)
                fcntl.flock(lock, fcntl.LOCK_EX)
                one_round(r, server)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())  # fmt: skip
    print(f"CPU: {cpu}, {os.cpu_count()} vCPU; Chromium headless, WASM, {args.threads} threads; prompt "
          f"{args.prompt_tokens}, {args.new_tokens} new tokens, {args.rounds} interleaved rounds")
    print("| checkpoint | precision | runtime | prefill ms | decode ms/token | load ms | MB downloaded "
          "| transformers.js / this, decode |")
    print("|---|---|---|---|---|---|---|---|")
    for c in configs:
        runs = [x for x in results[c] if "error" not in x]
        if not runs:
            print(f"| {c[0]} | {c[2]} | {c[1]} | error: {results[c][0].get('error')} | | | | |")
            continue
        ratio = ""
        if c[1] != "transformers.js":  # per round: transformers.js' decode time over this runtime's
            t = results[(c[0], "transformers.js", c[2])]
            rs = [a["decode_ms_per_token"] / b["decode_ms_per_token"] for a, b in zip(t, results[c])
                  if "error" not in a and "error" not in b]  # fmt: skip
            ratio = f"{statistics.median(rs):.2f}x [{min(rs):.2f}-{max(rs):.2f}]" if rs else ""
        print(f"| {c[0]} | {c[2]} | {c[1]} | {summary([x['prefill_ms'] for x in runs])} | "
              f"{summary([x['decode_ms_per_token'] for x in runs])} | {summary([x['load_ms'] for x in runs])} | "
              f"{statistics.median([x['bytes_downloaded'] for x in runs]) / 1e6:.1f} | {ratio} |")
    (args.work / "results.json").write_text(json.dumps({"/".join(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()

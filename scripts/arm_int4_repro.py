"""One 4-bit MatMulNBits (symmetric, block 32: the arm64-dotprod / -i8mm / -sve recipes' layers), run by ONNX
Runtime at accuracy levels 1 and 4, with and without KleidiAI, against NumPy models of each kernel (docs/arm.md).

    python scripts/arm_int4_repro.py                 prints each run's distance to the NumPy models; exits 1 when
                                                     the run gpt2edge's ARM recipes use (level 4, KleidiAI off)
                                                     is not MLAS's per-block scheme
    python scripts/arm_int4_repro.py --save X.npz    also keeps this CPU's outputs (on x86)
    python scripts/arm_int4_repro.py --against X.npz and compares them with another CPU's (on ARM); exits 1 when
                                                     the recipes' run is not x86's to float rounding

Needs numpy and onnxruntime only (the graph's protobuf is written by hand, as in scripts/arm_sme_repro.py). The
NumPy models, in float64:
  float      the dequantized weights times A (level 1's fp32 compute: MLAS dequantizes B, float GEMM)
  per-block  MLAS's CompInt8 (QuantizeARow_CompInt8, x86 and ARM alike): A quantized per block of 32 to
             symmetric int8 (scale max|a|/127, round to nearest), int32 dot with B's block, times both fp32
             scales
  per-row    KleidiAI's qai8dxp x qsi4c32p (kai_lhs_quant_pack_qai8dxp_f32, kai_rhs_pack_nxk_qsi4c32p): A
             quantized per row to asymmetric int8 (one scale and zero point over the whole row of K), B's block
             scales cut to bfloat16 (the top 16 bits of the float: truncated, not rounded)
On x86 both level-4 runs are per-block (no KleidiAI); on an ARM CPU with dotprod KleidiAI's run is per-row to ~1e-7
and the run without it per-block, equal to x86's to float rounding; without dotprod level 4 runs the float path
(MLAS has no 4-bit int8-activation kernel there).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arm_sme_repro import _field, _tensor, _value  # noqa: E402  (the hand-written protobuf helpers)

M_ROWS, K, N, BLOCK = (1, 8), 256, 256, 32
SAME = 1e-5  # relative distance that is float rounding (summation order), not another quantization scheme


def _attr(name: str, value: int) -> bytes:
    return _field(1, name) + _field(3, value) + _field(20, 2)  # AttributeProto: name, i, type INT


def model(packed: np.ndarray, scales: np.ndarray, level: int) -> bytes:
    """ModelProto of Y = MatMulNBits(A, B, scales): 4 bits, symmetric (no zero points: 8), blocks of BLOCK."""
    node = b"".join(_field(1, x) for x in ("A", "B", "scales")) + _field(2, "Y")
    node += _field(3, "mnb") + _field(4, "MatMulNBits") + _field(7, "com.microsoft")
    for name, v in (("K", K), ("N", N), ("bits", 4), ("block_size", BLOCK), ("accuracy_level", level)):
        node += _field(5, _attr(name, v))
    graph = _field(1, node) + _field(2, "int4_repro")
    graph += _field(5, _tensor("B", packed, 2)) + _field(5, _tensor("scales", scales, 1))
    graph += _field(11, _value("A", 1, ("M", K))) + _field(12, _value("Y", 1, ("M", N)))
    opsets = _field(8, _field(1, "") + _field(2, 17)) + _field(8, _field(1, "com.microsoft") + _field(2, 1))
    return _field(1, 8) + opsets + _field(7, graph)


def weights(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes - 8 as int (N, K), packed uint8 (N, K/BLOCK, BLOCK/2), scales float32 (N, K/BLOCK))."""
    w = rng.standard_normal((N, K)).astype(np.float32)
    blocks = w.reshape(N, K // BLOCK, BLOCK)
    scales = (np.abs(blocks).max(-1) / 7).astype(np.float32)
    codes = np.clip(np.round(blocks / scales[..., None]) + 8, 0, 15).astype(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return codes.reshape(N, K).astype(np.int64) - 8, packed, scales


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 cut to bfloat16 as KleidiAI's kai_cast_bf16_f32 does without the BF16 extension (the top 16 bits),
    back as float32."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def per_block(a: np.ndarray, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MLAS CompInt8: symmetric int8 A per block of BLOCK, int dot per block, fp32 scales."""
    ab = a.astype(np.float32).reshape(len(a), K // BLOCK, BLOCK)
    sa = (np.abs(ab).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(sa > 0, np.float32(1) / np.where(sa > 0, sa, 1), 0).astype(np.float32)
    qa = np.rint(ab * inv[..., None]).astype(np.int64)
    qb = q.reshape(N, K // BLOCK, BLOCK)
    dots = np.einsum("mbk,nbk->mnb", qa, qb).astype(np.float64)
    return np.einsum("mnb,mb,nb->mn", dots, sa.astype(np.float64), scales.astype(np.float64))


def per_row(a: np.ndarray, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """KleidiAI qai8dxp x qsi4c32p: asymmetric int8 A per row (nudged zero point), bf16 (cut) block scales of B."""
    a = a.astype(np.float32)
    rmin, rmax = np.minimum(a.min(1), 0), np.maximum(a.max(1), 0)
    scale = np.where(rmin == rmax, 1, np.float32(255) / np.where(rmin == rmax, 1, rmax - rmin)).astype(np.float32)
    dmin, dmax = rmin * scale, rmax * scale
    zp = np.where((-128 + dmin) + (127 + dmax) > 0, -128 - dmin, 127 - dmax)
    zp = np.rint(np.clip(zp, -128, 127)).astype(np.int64)
    qa = np.clip(np.round(a * scale[:, None]).astype(np.int64) + zp[:, None], -128, 127) - zp[:, None]
    qb = q.reshape(N, K // BLOCK, BLOCK)
    dots = np.einsum("mbk,nbk->mnb", qa.reshape(len(a), K // BLOCK, BLOCK), qb).astype(np.float64)
    return np.einsum("mnb,nb->mn", dots, bf16(scales).astype(np.float64)) / scale[:, None].astype(np.float64)


def run(onnx_bytes: bytes, a: np.ndarray, kleidiai: bool) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    if not kleidiai:
        opts.add_session_config_entry("mlas.disable_kleidiai", "1")
    sess = ort.InferenceSession(onnx_bytes, sess_options=opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": a})[0]


def rel(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max())


def main(argv: list[str] | None = None) -> int:
    from gpt2edge.cpu_facts import this_cpu

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", type=Path, help="keep this CPU's outputs here (npz)")
    ap.add_argument("--against", type=Path, help="compare with the outputs another CPU saved (npz)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    q, packed, scales = weights(rng)
    w = (q.reshape(N, K // BLOCK, BLOCK) * scales[..., None]).reshape(N, K).astype(np.float64)
    cpu = this_cpu()
    # what the recipes' run (level 4, KleidiAI off) must be: MLAS's CompInt8 needs dotprod on ARM, else the float path
    want = "per-block" if not cpu.arm64 or "asimddp" in cpu.features else "float"
    print(f"arm_int4_repro: {cpu.name}; features {' '.join(cpu.features) or '-'}; onnxruntime {ort.__version__}")
    print(f"  MatMulNBits 4-bit symmetric, block {BLOCK}, K={K} N={N}; relative max distance to each NumPy model")
    print(f"  {'run':44s} {'float':>9s} {'per-block':>9s} {'per-row':>9s}  closest")
    outs: dict[str, np.ndarray] = {}
    bad = 0
    for m in M_ROWS:
        a = rng.standard_normal((m, K)).astype(np.float32)
        refs = {
            "float": a.astype(np.float64) @ w.T,
            "per-block": per_block(a, q, scales),
            "per-row": per_row(a, q, scales),
        }
        for level in (1, 4):
            for kleidiai in (True, False):
                y = run(model(packed, scales, level), a, kleidiai)
                name = f"M={m} level {level} KleidiAI {'on (default)' if kleidiai else 'off'}"
                outs[f"m{m}_l{level}_{'on' if kleidiai else 'off'}"] = y
                d = {k: rel(y, r) for k, r in refs.items()}
                best = min(d, key=d.get)
                print(f"  {name:44s} {d['float']:9.2e} {d['per-block']:9.2e} {d['per-row']:9.2e}  {best}")
                if level == 4 and not kleidiai and (best != want or d[want] > SAME):
                    bad += 1  # the run the ARM recipes use: MLAS's per-block scheme, as on x86 (float without dotprod)
    if args.save is not None:
        np.savez(args.save, **outs)
    if args.against is not None:
        theirs = np.load(args.against)
        print(f"  against {args.against.name}: relative max distance of this CPU's outputs to theirs")
        for key, y in outs.items():
            d = rel(y, theirs[key].astype(np.float64))
            recipe = key.endswith("_l4_off")
            bad += recipe and want == "per-block" and d > SAME
            note = f"  (the recipes' run: {want})" if recipe else ""
            print(f"  {key:20s} {d:9.2e}{note}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

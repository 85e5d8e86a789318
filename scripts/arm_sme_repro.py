"""One DynamicQuantizeMatMul, run by ONNX Runtime with and without its KleidiAI kernels, against NumPy (docs/arm.md).

    python scripts/arm_sme_repro.py          prints each run's error against the float product; exits 1 when the
                                             run without KleidiAI (what gpt2edge's sessions use on SME CPUs) is off

Needs numpy, onnxruntime and gpt2edge (the graph's protobuf is written here by hand with
gpt2edge.onnx_io.wire's varint, so no onnx package). On a CPU with SME, ONNX Runtime 1.32 sends this op to
KleidiAI's SME2 kernels; elsewhere both runs take MLAS's own kernels and agree. Under QEMU 7.2's `max` CPU (SME,
no SME2) the KleidiAI run was far off; `max,sme=off` and the run with mlas.disable_kleidiai=1 match the reference
to int8 rounding.
"""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort

from gpt2edge.onnx_io.wire import varint as _varint  # the package's protobuf varint (pure Python, no onnx)

M_ROWS, K, N = (1, 8), 256, 256
TOLERANCE = 0.05  # relative error a per-tensor uint8 x per-column int8 product stays well under


def _field(num: int, value: bytes | int | str) -> bytes:
    """One protobuf field: an int as a varint, bytes/str length-delimited."""
    if isinstance(value, int):
        return _varint(num << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def _tensor(name: str, arr: np.ndarray, dtype: int) -> bytes:
    dims = b"".join(_field(1, d) for d in arr.shape)
    return dims + _field(2, dtype) + _field(8, name) + _field(9, arr.tobytes())


def _value(name: str, elem: int, dims: tuple) -> bytes:
    shape = b"".join(_field(1, _field(2, d) if isinstance(d, str) else _field(1, d)) for d in dims)
    return _field(1, name) + _field(2, _field(1, _field(1, elem) + _field(2, shape)))


def model(b: np.ndarray, scale: np.ndarray) -> bytes:
    """ModelProto of Y = DynamicQuantizeMatMul(A, B, b_scale): B int8 (K, N), per-column scales (N,)."""
    node = b"".join(_field(1, x) for x in ("A", "B", "b_scale")) + _field(2, "Y")
    node += _field(3, "dqmm") + _field(4, "DynamicQuantizeMatMul") + _field(7, "com.microsoft")
    graph = _field(1, node) + _field(2, "repro")
    graph += _field(5, _tensor("B", b, 3)) + _field(5, _tensor("b_scale", scale, 1))
    graph += _field(11, _value("A", 1, ("M", K))) + _field(12, _value("Y", 1, ("M", N)))
    opsets = _field(8, _field(1, "") + _field(2, 17)) + _field(8, _field(1, "com.microsoft") + _field(2, 1))
    return _field(1, 8) + opsets + _field(7, graph)


def run(onnx_bytes: bytes, a: np.ndarray, disable_kleidiai: bool) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    if disable_kleidiai:
        opts.add_session_config_entry("mlas.disable_kleidiai", "1")
    sess = ort.InferenceSession(onnx_bytes, sess_options=opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": a})[0]


def main() -> int:
    from gpt2edge.cpu_facts import this_cpu

    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N)).astype(np.float32)
    scale = (np.abs(w).max(0) / 127).astype(np.float32)
    b = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    onnx_bytes = model(b, scale)
    cpu = this_cpu()
    print(f"arm_sme_repro: {cpu.name}; features {' '.join(cpu.features) or '-'}; onnxruntime {ort.__version__}")
    bad = 0
    for m in M_ROWS:
        a = rng.standard_normal((m, K)).astype(np.float32)
        ref = a.astype(np.float64) @ (b.astype(np.float64) * scale)  # the float product of the int8 weights
        for off in (False, True):
            y = run(onnx_bytes, a, off)
            err = float(np.abs(y - ref).max() / np.abs(ref).max())
            ok = err <= TOLERANCE
            bad += off and not ok  # gpt2edge's sessions run without KleidiAI on SME CPUs: that run must be right
            what = "mlas.disable_kleidiai=1" if off else "default (KleidiAI where ORT picks it)"
            verdict = "ok" if ok else ("WRONG" if off else "WRONG (gpt2edge keeps this path off on SME CPUs)")
            print(f"  M={m} {what:40s} max rel error {err:.2e} {verdict}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Block-wise weight quantization primitives in MatMulNBits' layout, and their exact inverse.

A weight W (K, N) used as x @ W is stored transposed and cut into blocks of `block_size` along K:
  packed  (N, k_blocks, block_size * bits / 8) uint8, codes packed low nibble first (4 bit)
  scales  (N, k_blocks) float32
  zero_points (N, ceil(k_blocks * bits / 8)) uint8, packed the same way (absent when symmetric)
and W[k, n] ~= (code - zero_point) * scale. Packing is done by ONNX Runtime's own routine, so the layout is
exactly what its kernels read; dequantize_blockwise is the NumPy inverse (used by tests and the embedding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpt2edge.errors import QuantizeError

SUPPORTED_BITS = (4, 8)
# what ONNX Runtime's MatMulNBits packing (MlasQuantizeBlockwise) accepts: 512 and up abort in its C++ code
BLOCK_SIZES = (16, 32, 64, 128, 256)
# the 8-bit position table's preferred block (capped by n_embd like the tied table's, see embedding_block_size)
POSITION_BLOCK_SIZE = 128


@dataclass
class BlockQuantized:
    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    K: int
    N: int
    bits: int
    block_size: int

    @property
    def k_blocks(self) -> int:
        return -(-self.K // self.block_size)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + (0 if self.zero_points is None else self.zero_points.nbytes)


def check_block_size(block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise QuantizeError(
            f"--block-size must be a power of two from 16 to 256 ({', '.join(map(str, BLOCK_SIZES))}: what ONNX "
            f"Runtime's MatMulNBits supports), got {block_size}."
        )


def embedding_block_size(width: int, preferred: int) -> int:
    """The largest power of two <= preferred that divides the embedding width (rows are dequantized whole)."""
    block = min(preferred, width & -width)
    if block < BLOCK_SIZES[0]:
        raise QuantizeError(
            f"n_embd={width} is not a multiple of {BLOCK_SIZES[0]}: int8/int4 store the embedding tables in blocks "
            f"of {BLOCK_SIZES[0]}..{BLOCK_SIZES[-1]} that divide a row; quantize this model to fp16 instead."
        )
    return block


def quantize_blockwise(w_kn: np.ndarray, bits: int, block_size: int, symmetric: bool = False) -> BlockQuantized:
    """Quantize a (K, N) float32 matrix; asymmetric (min/max with a zero point) unless `symmetric`."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    if bits not in SUPPORTED_BITS:
        raise QuantizeError(f"{bits}-bit weights are not supported; choose one of {SUPPORTED_BITS}.")
    check_block_size(block_size)
    K, N = w_kn.shape
    k_blocks = -(-K // block_size)
    w = np.ascontiguousarray(w_kn, dtype=np.float32)
    if k_blocks * block_size != K:  # pad K with zeros; the kernel ignores the tail beyond K
        w = np.pad(w, ((0, k_blocks * block_size - K), (0, 0)))
    per_byte = 8 // bits
    packed = np.zeros((N, k_blocks, block_size // per_byte), dtype=np.uint8)
    scales = np.zeros((N, k_blocks), dtype=np.float32)
    zero_points = np.zeros((N, -(-k_blocks // per_byte)), dtype=np.uint8)
    fn = quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits
    fn(packed, w, scales, zero_points, block_size, N, w.shape[0], symmetric)
    return BlockQuantized(packed, scales, None if symmetric else zero_points, K, N, bits, block_size)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes (..., n) -> codes (..., n * 8 / bits), low nibble first."""
    if bits == 8:
        return packed
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def dequantize_blockwise(q: BlockQuantized) -> np.ndarray:
    """The (K, N) float32 matrix the kernel multiplies by."""
    codes = unpack_codes(q.packed, q.bits).astype(np.float32)  # (N, k_blocks, block_size)
    if q.zero_points is None:
        zp = np.float32(1 << (q.bits - 1))
    else:
        zp = unpack_codes(q.zero_points, q.bits)[:, : q.k_blocks].astype(np.float32)[..., None]
    w = (codes - zp) * q.scales[..., None]  # (N, k_blocks, block_size)
    return w.reshape(q.N, -1)[:, : q.K].T

"""A quantization recipe: the options of a mode, checked and filled in (built-in or a --target's defaults)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gpt2edge.errors import QuantizeError

# bits of the widest tensor each precision stores; a variant can only be made from a wider parent
WIDTH = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}
MODES = ("fp16", "int8", "int4")
# Block sizes and zero points chosen by measurement on a 2-core AMD Zen 4 (AVX-512 VNNI), GPT-2 small shape
# (benchmarks/README.md, "int4 against llama.cpp Q4_0"): ONNX Runtime's int8-activation kernels are partly
# compute-bound, the per-block work costs more than the bytes saved by small blocks. int4 at block 256 decodes
# faster than at 32 (the layers' matmuls 1.95 vs 2.83 ms a step) and its 128-token prefill matmuls run faster
# than int8's (55 vs 58 ms; block 32: 86 ms); zero points cost nothing there and lower the error.
DEFAULT_BLOCK_SIZE = {"int8": 128, "int4": 256}
# the tied head at 8 bits: int8 uses its own block; int4's at 256 (~0.2 ms a step less than at 128)
HEAD8_BLOCK_SIZE = {"int8": 128, "int4": 256}
# MatMulNBits' compute types: 0 as the input (float), 1 fp32, 2 fp16, 3 bf16, 4 int8 activations;
# 4 is ~2x faster than the float path (levels 0/1) here, and ~40x on AVX2 without VNNI
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
DEFAULT_ACCURACY_LEVEL = 4
HEAD_BITS = (4, 8)
# zero points (asymmetric) by default: at block 128/256 the kernels run as fast with them as without on
# AVX-512 VNNI, and the error is lower; --symmetric drops them (llama.cpp Q4_0's form; on AVX2 without VNNI
# the 4-bit kernel ran ~20 % faster without them)
DEFAULT_SYMMETRIC = {"int8": False, "int4": False}


@dataclass
class Recipe:
    mode: str
    block_size: int | None = None
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    head_bits: int | None = None  # None: head/embedding stay fp32
    symmetric: bool = False  # no zero points: code * scale (every table, the head's too)
    head_block: int | None = None  # the tied table's block once fitted to n_embd (None: the asked one)
    position_block: int | None = None  # the position table's block once fitted to n_embd
    block_defaulted: bool = False  # block_size is the mode's default, not asked for: fitted() may shrink it
    target: str | None = None  # the CPU the defaults were chosen for (targets.py); None: the built-in defaults
    int8_op: str = "MatMulNBits"  # int8 layers: weight-only MatMulNBits, or DynamicQuantizeMatMul (u8s8 GEMM)
    pad_unaligned: bool = False  # a default block that does not divide the rows pads them (<= 12.5 %) instead
    int8_op_unaligned: str | None = None  # and int8 layers then use this op (None: int8_op at a smaller block)
    kleidiai: bool = True  # False: the folder's sessions keep ONNX Runtime's KleidiAI kernels off (targets.py)

    @property
    def weight_bits(self) -> int | None:
        """Bits of the weight matrices (int8 / int4); None for fp16."""
        return {"int8": 8, "int4": 4}.get(self.mode)

    @property
    def head_block_size(self) -> int | None:
        """An 8-bit head uses its mode's head block (scales cost 4 bytes per block); a 4-bit head the main one;
        fitted, the largest power of two up to that which divides n_embd."""
        if self.head_bits is None:
            return None
        if self.head_block is not None:
            return self.head_block
        return HEAD8_BLOCK_SIZE[self.mode] if self.head_bits == 8 else self.block_size

    def fitted(self, n_embd: int, n_inner: int | None = None) -> Recipe:
        """The recipe as the graph will hold it: an embedding table's rows are dequantized whole, so its block
        is the largest power of two up to the asked one that divides n_embd; a width none of 16..256 divides is
        refused here, before any work. A default block_size shrinks likewise to divide every matrix's rows
        (n_embd and n_inner), so no block is padded (gpt2-xl's 1600: 64, not 256 with 12 % padding), unless the
        target pads (`pad_unaligned`: a larger block costing at most 12.5 % padding beats a smaller one there;
        int8 then switches to its `int8_op_unaligned`); one the user asked for is kept (rows padded)."""
        from gpt2edge.quantize.primitives import BLOCK_SIZES, POSITION_BLOCK_SIZE, embedding_block_size

        if self.mode == "fp16":
            return self
        fit = self
        if self.block_defaulted:
            rows = [n_embd, n_inner or 4 * n_embd]
            block = min([self.block_size, *(k & -k for k in rows)])  # the largest power of two dividing each
            # the largest block up to the default whose padding costs at most 1/8 more bytes on every row
            pad = next((b for b in BLOCK_SIZES[::-1] if b <= self.block_size and padded(rows, b) <= 1.125), block)
            if self.pad_unaligned and pad > block:
                if self.mode == "int8" and self.int8_op_unaligned is not None:
                    fit = replace(self, int8_op=self.int8_op_unaligned)  # a per-column op has no blocks to pad
                else:
                    fit = replace(self, block_size=pad)
            elif block >= BLOCK_SIZES[0]:
                fit = replace(self, block_size=block)
        head = None if fit.head_bits is None else embedding_block_size(n_embd, fit.head_block_size)
        return replace(fit, head_block=head, position_block=embedding_block_size(n_embd, POSITION_BLOCK_SIZE))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if self.mode != "fp16":
            out.update(
                weight_bits=self.weight_bits,
                block_size=self.block_size,
                accuracy_level=self.accuracy_level,
                head_bits=self.head_bits,
                head_block_size=self.head_block_size,
                position_table_bits=8,
                position_table_block_size=self.position_block,
                symmetric=self.symmetric,
                op="com.microsoft.MatMulNBits",
            )
            if self.int8_op != "MatMulNBits":
                out.update(layer_op=f"com.microsoft.{self.int8_op}", layer_quantization="per-column int8, symmetric")
        else:
            out.update(fp32_ops=["LayerNormalization", "Softmax", "LogSoftmax", "MLP GELU"], kv_dtype="float16")
        if self.target is not None:
            out["target"] = self.target
        if not self.kleidiai:  # read back by the runtime (ModelFolder.kleidiai), applied to every session
            out["kleidiai"] = False
        return out


def padded(rows: list[int], block: int) -> float:
    """The largest factor by which padding to whole blocks grows a row."""
    return max(-(-k // block) * block / k for k in rows)


def make_recipe(
    mode: str,
    block_size: int | None = None,
    accuracy_level: int | None = None,
    head_bits: int | None = None,
    keep_head_fp32: bool = False,
    symmetric: bool | None = None,
    target: str | None = None,
) -> Recipe:
    """Validate the options of a mode and fill in its defaults: the built-in ones, or `target`'s (a name of
    targets.TARGETS; "native": this machine's, probed). An option given explicitly always wins."""
    from gpt2edge.quantize.primitives import check_block_size
    from gpt2edge.quantize.targets import RECIPES, check_target

    if mode not in MODES:
        raise QuantizeError(f"Unknown mode '{mode}'; choose one of {', '.join(MODES)}.")
    if target is not None:
        target = check_target(None if target == "native" else target)  # an unknown name: refused here
    if mode == "fp16":
        if any(x is not None for x in (block_size, accuracy_level, head_bits, symmetric)) or keep_head_fp32:
            raise QuantizeError(
                "--block-size, --accuracy-level, --head-bits, --keep-head-fp32 and --symmetric/--asymmetric apply "
                "to int8/int4, not fp16."
            )
        return Recipe("fp16", target=target)
    tuned = RECIPES.get(target) if target is not None else None
    block_defaulted = block_size is None
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE[mode]
        if tuned is not None:
            block_size = tuned.int4_block if mode == "int4" else tuned.int8_block
    check_block_size(block_size)
    if accuracy_level is None:
        accuracy_level = DEFAULT_ACCURACY_LEVEL if tuned is None else tuned.accuracy_level
    if accuracy_level not in ACCURACY_LEVELS:
        raise QuantizeError(f"--accuracy-level must be 0..4, got {accuracy_level}.")
    if keep_head_fp32 and head_bits is not None:
        raise QuantizeError("Give either --keep-head-fp32 or --head-bits, not both.")
    if head_bits not in (None, *HEAD_BITS):
        raise QuantizeError(f"--head-bits must be 4 or 8, got {head_bits}.")
    if mode == "int8" and head_bits == 4:
        raise QuantizeError("--head-bits 4 is for int4; an int8 model keeps its head at 8 bits or fp32.")
    if symmetric is None:
        symmetric = DEFAULT_SYMMETRIC[mode] if tuned is None or mode != "int4" else tuned.int4_symmetric
    if head_bits is None and tuned is not None and not keep_head_fp32:
        head_bits = tuned.head_bits
    head_bits = None if keep_head_fp32 else (8 if head_bits is None else head_bits)
    int8_op = tuned.int8_op if tuned is not None and mode == "int8" else "MatMulNBits"
    pad_unaligned = tuned is not None and tuned.pad_unaligned
    int8_op_unaligned = tuned.int8_op_unaligned if tuned is not None and int8_op == "MatMulNBits" else None
    return Recipe(
        mode,
        block_size,
        accuracy_level,
        head_bits,
        symmetric,
        block_defaulted=block_defaulted,
        target=target,
        int8_op=int8_op,
        pad_unaligned=pad_unaligned,
        int8_op_unaligned=int8_op_unaligned,
        kleidiai=tuned is None or tuned.kleidiai,
    )

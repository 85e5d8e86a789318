"""CPU targets for `quantize --target`: which one this machine is, found by running the instructions, and the
recipe each gets.

A flag in /proc/cpuinfo says what the CPU advertises, not what it runs: on a VM an Intel Xeon may list
amx_tile / amx_int8 and still fault (SIGILL) on the first tile instruction, and Linux hands AMX state out only
on request (arch_prctl ARCH_REQ_XCOMP_PERM). So each candidate is probed in a child process that executes a
few bytes of machine code for it; a crash there costs the child only. Every recipe writes standard ONNX Runtime
contrib ops that run on any CPU: a target changes speed, never whether a folder runs.

On ARM (aarch64) the kernel's HWCAP bits are the probe (gpt2edge/cpu_facts.py): Linux sets one only when the CPU
has the feature and the kernel enables it, so no instruction needs running; the CPU's model name is never read.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import cache

from gpt2edge import cpu_facts
from gpt2edge.errors import QuantizeError
from gpt2edge.manifest.fields import QUANTIZE_TARGETS

TARGETS = QUANTIZE_TARGETS
# what `quantize --target` accepts: a target, or native (this machine's, probed)
TARGET_CHOICES = ("native", *TARGETS)
X86_TARGETS = ("amx", "avx512-vnni", "avx2", "generic")  # best first
ARM_TARGETS = ("arm64-sve", "arm64-i8mm", "arm64-dotprod", "arm64")  # best first

# x86-64 code run by the probe: each ends in `ret`; the AMX one gets its tile config's address in rdi
_CODE = {
    # vpaddd ymm0, ymm0, ymm0; vzeroupper; ret
    "avx2": "c5fdfec0" "c5f877" "c3",
    # vpdpbusd zmm0, zmm0, zmm0 (AVX512-VNNI); vzeroupper; ret
    "avx512-vnni": "62f27d4850c0" "c5f877" "c3",
    # ldtilecfg [rdi]; tilezero tmm0; tilerelease; ret
    "amx": "c4e2784907" "c4e27b49c0" "c4e27849c0" "c3",
}
# flags each target needs in /proc/cpuinfo before it is worth probing
_FLAGS = {"avx2": {"avx2", "fma"}, "avx512-vnni": {"avx512f", "avx512_vnni"}, "amx": {"amx_tile", "amx_int8"}}

_PROBE = r"""
import ctypes, mmap, sys
code = bytes.fromhex(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
if sys.argv[2] == "amx":
    # Linux grants the AMX tile state per process: ARCH_REQ_XCOMP_PERM (0x1023), XFEATURE_XTILEDATA (18)
    if libc.syscall(158, 0x1023, 18) != 0:
        sys.exit(3)
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(code)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
cfg = (ctypes.c_uint8 * 64)()
cfg[0] = 1  # palette 1; tile 0: 16 rows of 64 bytes
cfg[16] = 64
cfg[48] = 16
ctypes.CFUNCTYPE(None, ctypes.c_void_p)(addr)(ctypes.addressof(cfg))
print("ok")
"""


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists for the first CPU (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_name() -> str:
    """This CPU's name: x86's model name, ARM's cores from their MIDR (gpt2edge/cpu_facts.py)."""
    return cpu_facts.this_cpu().name


def probe(target: str, timeout: float = 20.0) -> bool:
    """Whether this CPU executes `target`'s instructions: run them in a child process (SIGILL kills the child)."""
    if target == "generic":
        return True
    if target in ARM_TARGETS:  # the kernel's HWCAP says it (cpu_facts); no code to run
        return cpu_facts.this_cpu().runs(target)
    if platform.machine().lower() not in ("x86_64", "amd64") or not sys.platform.startswith("linux"):
        return False
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, _CODE[target], target], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip() == "ok"


@dataclass(frozen=True)
class CpuReport:
    """What the CPU advertises and what the probes found it runs; `target` is the best runnable one."""

    name: str
    flags: tuple[str, ...]  # the flags that matter to the targets
    advertised: tuple[str, ...]
    runs: tuple[str, ...]
    target: str

    def to_json(self) -> dict:
        return asdict(self)


@cache
def detect() -> CpuReport:
    """Probe this machine once per process: the best target whose flags are listed AND whose code runs."""
    facts = cpu_facts.this_cpu()
    if facts.arm64:
        return arm_report(facts)
    flags = cpu_flags()
    advertised = tuple(t for t in TARGETS if t == "generic" or (t in _FLAGS and _FLAGS[t] <= flags))
    runs = tuple(t for t in advertised if probe(t))
    best = next(t for t in ("amx", "avx512-vnni", "avx2", "generic") if t in runs)
    wanted = set().union(*_FLAGS.values()) | {"avx512bw", "avx512_bf16", "amx_bf16", "avx_vnni"}
    return CpuReport(cpu_name(), tuple(sorted(flags & wanted)), advertised, runs, best)


def arm_report(facts: cpu_facts.CpuFacts) -> CpuReport:
    """An aarch64 CPU's report: the ARM targets whose features HWCAP (or the Features line) lists. NEON (asimd) is
    part of every aarch64 Linux, so `arm64` is the floor even where no feature could be read: never `generic`."""
    runs = tuple(t for t in ARM_TARGETS if facts.runs(t)) or ("arm64",)
    return CpuReport(facts.name, facts.features, runs, runs, runs[0])


@dataclass(frozen=True)
class TargetRecipe:
    """The defaults a target gives `quantize` (an option given on the command line still wins)."""

    int4_block: int
    int4_symmetric: bool
    int8_block: int
    int8_op: str  # "MatMulNBits" (weight-only, 8-bit blocks) or "DynamicQuantizeMatMul" (per-column int8)
    accuracy_level: int
    head_bits: int
    measured: str  # where these were measured, or why they were chosen without a measurement
    # rows the default block does not divide (gpt2-xl's 1600): pad them to whole blocks (up to 12.5 % more
    # bytes) instead of shrinking the block, and int8 layers use this op instead of a smaller 8-bit block
    pad_unaligned: bool = False
    int8_op_unaligned: str | None = None


RECIPES = {
    # measured on AMD Zen 4 and Zen 5 (2 vCPU, AVX-512 VNNI): benchmarks/README.md ("Recipes per CPU")
    # gpt2-xl (rows of 1600) on Zen 5: int4 at block 256 padded decodes in 0.93x [0.87, 0.94] the time of block
    # 64 and prefills in 0.76x; int8 as DynamicQuantizeMatMul in 0.79x [0.77, 0.81] of 8-bit block 64 (4 rounds)
    "avx512-vnni": TargetRecipe(
        256, False, 128, "MatMulNBits", 4, 8, "AMD Zen 4 / Zen 5, AVX-512 VNNI", True, "DynamicQuantizeMatMul"
    ),
    # AVX2 without VNNI: the 4-bit kernel ran ~20 % faster without zero points (Zen 3, earlier sessions);
    # level 4 stays: the float path was ~40x slower there
    "avx2": TargetRecipe(256, True, 128, "MatMulNBits", 4, 8, "AMD Zen 3 (AVX2): int4 symmetric ~20 % faster"),
    # AMX: ONNX Runtime's u8s8 GEMM (MatMulInteger / DynamicQuantizeMatMul) has AMX kernels, MatMulNBits none;
    # chosen from the kernels' code, not measured here (this session's CPU has no AMX)
    "amx": TargetRecipe(256, False, 128, "DynamicQuantizeMatMul", 4, 8, "not measured: no AMX CPU this session"),
    # any other CPU (old x86, a CPU nothing was probed on): small blocks and the float compute path
    "generic": TargetRecipe(32, False, 32, "MatMulNBits", 0, 8, "portable defaults, not tuned"),
    # ARM, from reading ONNX Runtime 1.32's MLAS sources (docs/arm.md, "Recipes"); emulation gives no timings, so
    # none of these is measured. Without dotprod MLAS has no int8-activation MatMulNBits kernel (its CompInt8
    # dispatch is only filled in with dotprod): 4-bit runs the fp32 path (level 1, zero points cost nothing
    # there), and int8 layers are DynamicQuantizeMatMul, whose u8s8 GEMM has plain NEON kernels (8-bit
    # MatMulNBits would dequantize B every call)
    "arm64": TargetRecipe(32, False, 128, "DynamicQuantizeMatMul", 1, 8, "inferred from MLAS source: NEON only"),
    # dotprod: level 4 reaches KleidiAI's qai8dxp x qsi4c32p kernels, which MLAS takes only for blocks that are a
    # multiple of 32 dividing K, without zero points (UseKleidiAI); block 32 is their native block and
    # onnxruntime-genai's CPU default. 8-bit MatMulNBits at level 4 has MLAS's UDOT kernel (blocks of 16k)
    "arm64-dotprod": TargetRecipe(32, True, 128, "MatMulNBits", 4, 8, "inferred from MLAS source: dotprod"),
    # i8mm: the same choice; KleidiAI picks its i8mm ukernel for prefill (M > 1) itself, and 8-bit MatMulNBits
    # switches to USDOT: nothing in the folder differs, only the kernels that run it
    "arm64-i8mm": TargetRecipe(32, True, 128, "MatMulNBits", 4, 8, "inferred from MLAS source: i8mm"),
    # SVE: MLAS uses it for Erf/Logistic/softmax reductions and fp16 GEMM, not for the int8/int4 matmuls, whose
    # kernels here are i8mm's (Graviton 3/4, Neoverse V1/V2 all have i8mm): the i8mm recipe
    "arm64-sve": TargetRecipe(32, True, 128, "MatMulNBits", 4, 8, "inferred from MLAS source: SVE + i8mm"),
}


def check_target(target: str | None) -> str:
    """The named target, or this machine's (probed) when None; an unknown name is refused."""
    if target is None:
        return detect().target
    if target not in TARGETS:
        raise QuantizeError(f"Unknown --target '{target}'; choose one of {', '.join(TARGETS)}.")
    if target not in ARM_TARGETS:  # an x86 target is taken as asked (the probe's child processes are not run)
        return target
    report = detect()
    # an ARM target this ARM CPU cannot run is a mistake about the CPU; another architecture's CPU (x86 making a
    # folder for a board) cannot be probed from here, so its targets are taken as asked
    if report.target in ARM_TARGETS and target not in report.runs:
        need = ", ".join(cpu_facts.ARM_TARGETS[target])
        raise QuantizeError(
            f"--target {target} needs {need}; the probe found {report.name} with "
            f"{', '.join(report.flags) or 'no readable features'} (it runs {', '.join(report.runs)}): choose one of "
            f"those, or quantize for {target} on the CPU that runs it (or on x86)."
        )
    return target

"""What this CPU is, as the OS exposes it: its name, the ARM features it runs, whether it is emulated.

Torch-free and cheap (the runtime and `bench` both use it). On ARM Linux the kernel states what user space may run
in the ELF auxiliary vector (AT_HWCAP / AT_HWCAP2, read with getauxval): it sets a bit only when the CPU has the
feature and the kernel enables it, so it is the probe; the Features line of /proc/cpuinfo (the same bits by name)
is the fallback. The CPU's name comes from its MIDR (implementer and part numbers), never from a marketing string.
"""

from __future__ import annotations

import ctypes
import platform
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

AT_HWCAP, AT_HWCAP2 = 16, 26
# (auxv entry, bit) of the features the ARM targets and guards read: Linux arch/arm64/include/uapi/asm/hwcap.h
HWCAP_BITS = {
    "asimd": (AT_HWCAP, 1),
    "asimddp": (AT_HWCAP, 20),  # SDOT/UDOT (Armv8.2 dotprod)
    "sve": (AT_HWCAP, 22),
    "sve2": (AT_HWCAP2, 1),
    "i8mm": (AT_HWCAP2, 13),  # SMMLA/USMMLA/USDOT (Armv8.6 int8 matrix multiply)
    "bf16": (AT_HWCAP2, 14),
    "sme": (AT_HWCAP2, 23),
}
# what each ARM target of `quantize --target` needs the CPU to run (gpt2edge/quantize/targets.py)
ARM_TARGETS = {
    "arm64": ("asimd",),
    "arm64-dotprod": ("asimd", "asimddp"),
    "arm64-i8mm": ("asimd", "asimddp", "i8mm"),
    "arm64-sve": ("asimd", "asimddp", "i8mm", "sve"),
}
ARM64 = ("aarch64", "arm64")
X86 = ("x86_64", "amd64", "i386", "i686")
# x86 flags whose int8 dot products ONNX Runtime's u8s8 GEMM uses without saturating (vpdpbusd, AMX tiles); with
# AVX2 / AVX-512 alone it multiplies with vpmaddubsw, whose int16 pair sums saturate on 8-bit weights
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
DYNAMIC_INT8 = "com.microsoft.DynamicQuantizeMatMul"  # a recipe's layer_op with per-column 8-bit weights
ARM32 = ("armv6l", "armv7l", "armv7", "armv8l", "arm")
# MIDR implementer -> {part -> name}: the cores of boards, phones and servers (Arm's TRMs, Linux's cputype.h)
MIDR_NAMES = {
    0x41: {
        0xD03: "Cortex-A53", 0xD04: "Cortex-A35", 0xD05: "Cortex-A55", 0xD07: "Cortex-A57", 0xD08: "Cortex-A72",
        0xD09: "Cortex-A73", 0xD0A: "Cortex-A75", 0xD0B: "Cortex-A76", 0xD0C: "Neoverse-N1", 0xD0D: "Cortex-A77",
        0xD40: "Neoverse-V1", 0xD41: "Cortex-A78", 0xD42: "Cortex-A78AE", 0xD44: "Cortex-X1", 0xD46: "Cortex-A510",
        0xD47: "Cortex-A710", 0xD48: "Cortex-X2", 0xD49: "Neoverse-N2", 0xD4B: "Cortex-A78C", 0xD4D: "Cortex-A715",
        0xD4E: "Cortex-X3", 0xD4F: "Neoverse-V2", 0xD80: "Cortex-A520", 0xD81: "Cortex-A720", 0xD82: "Cortex-X4",
        0xD84: "Neoverse-V3", 0xD8E: "Neoverse-N3",
    },
    0x4E: {0x004: "NVIDIA Carmel"},
    0xC0: {0xAC3: "Ampere-1", 0xAC4: "Ampere-1a"},
    0x61: {0x022: "Apple M1 Icestorm", 0x023: "Apple M1 Firestorm"},
    0x00: {0x051: "QEMU max"},  # QEMU's `max` CPU: implementer 0 (reserved for software), part 'Q'
}  # fmt: skip
CPUINFO = Path("/proc/cpuinfo")
MODALIAS = Path("/sys/devices/system/cpu/modalias")
MIDR_SYSFS = Path("/sys/devices/system/cpu/cpu0/regs/identification/midr_el1")


def getauxval(kind: int) -> int | None:
    """The auxiliary vector's entry `kind` (glibc/bionic getauxval); None where libc has no such call."""
    try:
        fn = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    return int(fn(kind))


def cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per processor block (keys lower-cased); a trailing non-processor block (ARM's
    old 'Hardware' lines) is kept too."""
    blocks, cur = [], {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                blocks.append(cur)
            cur = {}
            continue
        key, sep, value = line.partition(":")
        if sep:
            cur[key.strip().lower()] = value.strip()
    if cur:
        blocks.append(cur)
    return blocks


def read_text(path: Path) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def arm_features(hwcap: int | None, hwcap2: int | None, cpuinfo: str = "") -> set[str]:
    """The named ARM features this CPU runs: from HWCAP/HWCAP2 when the kernel gave them, else the Features line."""
    if hwcap:
        words = {AT_HWCAP: hwcap, AT_HWCAP2: hwcap2 or 0}
        return {name for name, (kind, bit) in HWCAP_BITS.items() if words[kind] >> bit & 1}
    for block in cpuinfo_blocks(cpuinfo):
        if "features" in block:
            return set(block["features"].split()) & set(HWCAP_BITS)
    return set()


def midr_name(implementer: int, part: int) -> str:
    """A core's name from its MIDR fields; unknown ones by number, never guessed."""
    name = MIDR_NAMES.get(implementer, {}).get(part)
    return name or f"ARM core (implementer 0x{implementer:02x}, part 0x{part:03x})"


def arm_core_names(cpuinfo: str, midr_sysfs: str = "") -> list[str]:
    """The distinct core names of an ARM CPU, in order (big.LITTLE SoCs list two or three), from the
    'CPU implementer' / 'CPU part' lines, else cpu0's MIDR_EL1 in sysfs."""
    names: list[str] = []
    for block in cpuinfo_blocks(cpuinfo):
        try:
            name = midr_name(int(block["cpu implementer"], 0), int(block["cpu part"], 0))
        except (KeyError, ValueError):
            continue
        if name not in names:
            names.append(name)
    if not names and midr_sysfs.strip():
        midr = int(midr_sysfs.strip(), 16)
        names.append(midr_name(midr >> 24 & 0xFF, midr >> 4 & 0xFFF))
    return names


def emulation_reason(machine: str, cpuinfo: str, modalias: str) -> str | None:
    """Why this ARM process is running under an emulator (qemu-user), or None: the kernel below says it is
    another architecture (sysfs's CPU modalias), or /proc/cpuinfo is an x86 one passed through."""
    if machine.lower() not in ARM64 + ARM32:
        return None
    kind = modalias.strip().split(":")[2] if modalias.startswith("cpu:type:") else ""
    if kind and not kind.lower().startswith(("aarch64", "arm")):
        return f"the kernel is {kind.split(',')[0]} (sysfs cpu modalias)"
    blocks = cpuinfo_blocks(cpuinfo)
    if blocks and ("vendor_id" in blocks[0] or "flags" in blocks[0]):
        return "/proc/cpuinfo is an x86 CPU's"
    return None


@dataclass(frozen=True)
class CpuFacts:
    """This CPU as one record: `name` for people, `features` the ARM ones it runs (empty elsewhere)."""

    machine: str
    name: str
    features: tuple[str, ...] = ()
    emulated: str | None = None  # why it looks emulated (qemu-user), or None
    cores: tuple[str, ...] = field(default=())
    int8_dot: tuple[str, ...] | None = None  # x86: the INT8_DOT_FLAGS it lists (None: no flags line to read)

    @property
    def arm64(self) -> bool:
        return self.machine.lower() in ARM64

    def runs(self, target: str) -> bool:
        """Whether this CPU runs every feature an ARM target needs (False off ARM)."""
        return self.arm64 and set(ARM_TARGETS[target]) <= set(self.features)

    @property
    def u8s8_saturates(self) -> bool:
        """An x86 CPU whose flags list no VNNI or AMX: ONNX Runtime's u8s8 GEMM saturates on 8-bit weights here
        (False where that cannot be told: off x86, or no /proc/cpuinfo)."""
        return self.machine.lower() in X86 and self.int8_dot is not None and not self.int8_dot

    def to_json(self) -> dict:
        return {"machine": self.machine, "name": self.name, "features": list(self.features), "emulated": self.emulated}


def facts(
    machine: str | None = None, cpuinfo: str | None = None, hwcap: tuple[int | None, int | None] | None = None,
    modalias: str | None = None, midr_sysfs: str | None = None,
) -> CpuFacts:  # fmt: skip
    """This machine's CpuFacts; every source can be given instead (the tests fake an ARM CPU on x86)."""
    machine = machine or platform.machine()
    text = read_text(CPUINFO) if cpuinfo is None else cpuinfo
    alias = read_text(MODALIAS) if modalias is None else modalias
    emulated = emulation_reason(machine, text, alias)
    if machine.lower() not in ARM64 + ARM32:
        blocks = cpuinfo_blocks(text)
        name = (blocks[0].get("model name") if blocks else None) or platform.processor() or machine
        flags = blocks[0].get("flags") if blocks else None
        dot = None if flags is None else tuple(f for f in INT8_DOT_FLAGS if f in flags.split())
        return CpuFacts(machine, name, int8_dot=dot)
    if hwcap is None:
        hwcap = (getauxval(AT_HWCAP), getauxval(AT_HWCAP2))
    # an x86 /proc/cpuinfo passed through by the emulator says nothing about the emulated CPU
    arm_text = "" if emulated and emulated.startswith("/proc/cpuinfo") else text
    features = arm_features(hwcap[0], hwcap[1], arm_text)
    midr = read_text(MIDR_SYSFS) if midr_sysfs is None else midr_sysfs
    cores = arm_core_names(arm_text, "" if emulated else midr)
    name = " + ".join(cores) or f"{machine} CPU (no MIDR readable)"
    if emulated:
        name = f"{name}, emulated: {emulated}"
    return CpuFacts(machine, name, tuple(sorted(features)), emulated, tuple(cores))


@cache
def this_cpu() -> CpuFacts:
    """facts() of this machine, read once per process."""
    return facts()


def target_note(manifest: dict, where: str, cpu: CpuFacts | None = None) -> str | None:
    """A note for a folder quantized for an ARM target whose features this ARM CPU lacks (a Pi 5 folder on a Pi 4):
    it runs correctly, as every recipe's ops run on any CPU, on ONNX Runtime's slower kernels; for a folder whose
    int8 layers are DynamicQuantizeMatMul (the amx and arm64 recipes, xl at avx512-vnni) on an x86 CPU without
    VNNI: it runs, at a lower quality; None otherwise."""
    recipe = (manifest.get("quantization") or {}).get("recipe") or {}
    target = recipe.get("target")
    cpu = this_cpu() if cpu is None else cpu
    if recipe.get("layer_op") == DYNAMIC_INT8 and cpu.u8s8_saturates:
        return (
            f"{where}'s int8 layers are DynamicQuantizeMatMul (8-bit weights, for {target or 'another CPU'}); this CPU "
            f"({cpu.name}) has no VNNI, where ONNX Runtime's u8s8 kernel saturates their sums: it runs, at a lower "
            "quality (a test model: mean KL 7e-2 instead of 1e-3); quantize for this CPU with --target native."
        )
    if target not in ARM_TARGETS:
        return None
    if not cpu.arm64 or cpu.runs(target):
        return None
    missing = ", ".join(f for f in ARM_TARGETS[target] if f not in cpu.features)
    return (
        f"{where} was quantized for {target}; this CPU ({cpu.name}) lacks {missing}: it runs correctly, on ONNX "
        "Runtime's kernels for what this CPU has (slower); quantize for this CPU with --target native."
    )


def arm32_message(machine: str | None = None) -> str | None:
    """One line for a 32-bit ARM Python (armv7l: no ONNX Runtime wheels, no 64-bit kernels), else None."""
    machine = machine or platform.machine()
    if machine.lower() in ARM32:
        return (
            f"gpt2edge needs a 64-bit ARM (aarch64) Python; this one is {machine} (32-bit ARM): install a 64-bit "
            "OS (Raspberry Pi OS 64-bit, aarch64 Termux) and its python3."
        )
    return None


def exit_on_arm32(machine: str | None = None) -> None:
    """The CLI's start on a 32-bit ARM Python: `error:` and that line on stderr, exit status 1."""
    line = arm32_message(machine)
    if line is not None:
        sys.stderr.write(f"error: {line}\n")
        raise SystemExit(1)

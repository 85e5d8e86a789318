"""The platform facts on ARM, from faked HWCAP words, /proc/cpuinfo texts and sysfs files (runs on any CPU, and
torch-free, so the aarch64 lane runs it too): feature bits, core names from MIDR, emulation, the ARM targets
each CPU gets, the refusal of one it cannot run, the SME guard and the 32-bit ARM line."""

from __future__ import annotations

import pytest

from gpt2edge import cpu_facts as cf
from gpt2edge.quantize import targets as tg
from gpt2edge.runtime.model.ort_session import kleidiai_off

A72 = "fp asimd evtstrm crc32 cpuid"
N1 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"


def cpuinfo(*cores: tuple[int, int], features: str = A72) -> str:
    """An arm64 /proc/cpuinfo with one block per (implementer, part)."""
    return "".join(
        f"processor\t: {i}\nBogoMIPS\t: 108.00\nFeatures\t: {features}\nCPU implementer\t: 0x{imp:02x}\n"
        f"CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0x{part:03x}\nCPU revision\t: 3\n\n"
        for i, (imp, part) in enumerate(cores)
    )


def hw(*names: str) -> tuple[int, int]:
    """HWCAP and HWCAP2 words with these features' bits set (asimd always: every aarch64 has it)."""
    words = {cf.AT_HWCAP: 0, cf.AT_HWCAP2: 0}
    for name in ("asimd", *names):
        kind, bit = cf.HWCAP_BITS[name]
        words[kind] |= 1 << bit
    return words[cf.AT_HWCAP], words[cf.AT_HWCAP2]


def arm(text: str, hwcap=(0, 0), modalias: str = "cpu:type:aarch64:feature:,0000,0001", midr: str = "") -> cf.CpuFacts:
    return cf.facts(machine="aarch64", cpuinfo=text, hwcap=hwcap, modalias=modalias, midr_sysfs=midr)


def test_hwcap_bits_are_the_kernels():
    # Linux's arch/arm64/include/uapi/asm/hwcap.h
    assert cf.HWCAP_BITS["asimddp"] == (16, 20) and cf.HWCAP_BITS["sve"] == (16, 22)
    assert cf.HWCAP_BITS["i8mm"] == (26, 13) and cf.HWCAP_BITS["sme"] == (26, 23)


def test_raspberry_pi_4_is_a72_neon_only():
    f = arm(cpuinfo(*[(0x41, 0xD08)] * 4), hw())
    assert f.name == "Cortex-A72" and f.features == ("asimd",) and f.emulated is None
    report = tg.arm_report(f)
    assert report.target == "arm64" and report.runs == ("arm64",)


def test_hwcap_wins_over_the_features_line_and_the_model_name_is_never_read():
    # the Features line claims dotprod and a model name says "i8mm"; HWCAP (what the kernel enables) says neither
    text = cpuinfo((0x41, 0xD0B), features=N1).replace("processor", "model name\t: Fast i8mm chip\nprocessor", 1)
    f = arm(text, hw())
    assert f.features == ("asimd",) and tg.arm_report(f).target == "arm64"
    # no HWCAP (a libc without getauxval): the Features line is the fallback
    assert "asimddp" in arm(text, (None, None)).features


@pytest.mark.parametrize(
    "features, target",
    [((), "arm64"), (("asimddp",), "arm64-dotprod"), (("asimddp", "i8mm"), "arm64-i8mm"),
     (("asimddp", "i8mm", "sve", "sve2"), "arm64-sve"), (("sve",), "arm64")],
)  # fmt: skip
def test_arm_targets_follow_the_features(features, target):
    f = arm(cpuinfo((0x41, 0xD4F)), hw(*features))
    assert tg.arm_report(f).target == target
    assert tg.arm_report(f).target != "generic"  # native on ARM is never the portable x86 fallback


def test_arm_with_nothing_readable_is_still_arm64():
    f = arm("", (None, None))
    assert f.features == () and tg.arm_report(f).target == "arm64" and "aarch64" in f.name


def test_big_little_names_both_clusters_and_sysfs_midr_is_the_fallback():
    f = arm(cpuinfo((0x41, 0xD05), (0x41, 0xD05), (0x41, 0xD0B)), hw("asimddp"))
    assert f.name == "Cortex-A55 + Cortex-A76"
    assert arm("", hw(), midr="0x00000000414fd0c1").name == "Neoverse-N1"  # MIDR_EL1: 0x41, part 0xd0c
    assert "part 0x123" in arm(cpuinfo((0x41, 0x123)), hw()).name  # unknown: by number, not guessed


def test_emulation_is_detected_from_the_kernel_or_an_x86_cpuinfo():
    qemu = arm(cpuinfo((0x41, 0xD0C), features=N1), hw("asimddp"), modalias="cpu:type:x86,ven0000fam0006:feature:,0")
    assert qemu.emulated and "x86" in qemu.emulated and qemu.name.startswith("Neoverse-N1, emulated")
    x86_text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\nflags\t\t: fpu sse2 avx2\n\n"
    passed = arm(x86_text, hw(), modalias="")
    assert passed.emulated == "/proc/cpuinfo is an x86 CPU's" and "Xeon" not in passed.name
    assert arm(cpuinfo((0x41, 0xD08)), hw()).emulated is None
    assert cf.facts(machine="x86_64", cpuinfo=x86_text, modalias="cpu:type:x86").emulated is None


def test_a_target_this_arm_cpu_cannot_run_is_refused_naming_what_was_found(monkeypatch):
    pi4 = tg.arm_report(arm(cpuinfo((0x41, 0xD08)), hw()))
    monkeypatch.setattr(tg, "detect", lambda: pi4)
    with pytest.raises(Exception, match=r"arm64-i8mm needs .*i8mm.*Cortex-A72 with asimd.*runs arm64"):
        tg.check_target("arm64-i8mm")
    assert tg.check_target("arm64") == "arm64"
    assert tg.check_target("avx2") == "avx2"  # another architecture's target: this CPU cannot speak for it


def test_arm_recipes_reach_the_kernels_they_are_chosen_for(monkeypatch):
    from gpt2edge.quantize.recipe import make_recipe

    # made on x86 for a board (on an emulated ARM CPU the targets it lacks are refused: the test above)
    monkeypatch.setattr(tg, "detect", lambda: tg.CpuReport("x86", (), ("generic",), ("generic",), "generic"))

    # without dotprod: the float path for 4-bit, DynamicQuantizeMatMul for 8-bit
    r = make_recipe("int4", target="arm64")
    assert (r.block_size, r.accuracy_level, r.symmetric) == (32, 1, False)
    assert make_recipe("int8", target="arm64").int8_op == "DynamicQuantizeMatMul"
    for target in ("arm64-dotprod", "arm64-i8mm", "arm64-sve"):
        r = make_recipe("int4", target=target)
        # KleidiAI: level 4, symmetric, a block of 32k dividing K (fitted never pads on ARM)
        assert (r.block_size % 32, r.accuracy_level, r.symmetric, r.pad_unaligned) == (0, 4, True, False)
        assert r.fitted(1600).block_size == 32 and r.to_json()["target"] == target
        assert make_recipe("int8", target=target).int8_op == "MatMulNBits"


def test_kleidiai_is_turned_off_on_sme_unless_asked_for():
    assert kleidiai_off(("asimd", "sme"), env={}) is True
    assert kleidiai_off(("asimd", "sme"), env={"GPT2EDGE_KLEIDIAI": "1"}) is False
    assert kleidiai_off(("asimd", "asimddp", "i8mm"), env={}) is False
    assert kleidiai_off((), env={}) is False


def test_32_bit_arm_python_gets_one_line_naming_aarch64():
    line = cf.arm32_message("armv7l")
    assert "aarch64" in line and "armv7l" in line and "\n" not in line
    assert cf.arm32_message("aarch64") is None and cf.arm32_message("x86_64") is None


def test_a_folder_for_features_this_arm_cpu_lacks_gets_a_note_and_no_refusal():
    manifest = {"quantization": {"recipe": {"target": "arm64-i8mm"}}}
    pi4 = arm(cpuinfo((0x41, 0xD08)), hw())
    note = cf.target_note(manifest, "m/int4", pi4)
    assert "arm64-i8mm" in note and "Cortex-A72" in note and "asimddp, i8mm" in note and "runs correctly" in note
    assert cf.target_note(manifest, "m", arm(cpuinfo((0x41, 0xD4F)), hw("asimddp", "i8mm"))) is None
    assert cf.target_note(manifest, "m", cf.facts(machine="x86_64", cpuinfo="")) is None  # ARM's folders on x86
    assert cf.target_note({"quantization": {"recipe": {"target": "avx2"}}}, "m", pi4) is None
    assert cf.target_note({}, "m", pi4) is None


def test_dynamic_int8_layers_on_an_x86_cpu_without_vnni_get_a_note():
    # ONNX Runtime's u8s8 GEMM saturates on 8-bit weights with AVX2 / AVX-512 alone, not with VNNI or AMX
    def x86(flags: str | None):
        text = "processor\t: 0\nmodel name\t: Test CPU\n" + ("" if flags is None else f"flags\t\t: {flags}\n")
        return cf.facts(machine="x86_64", cpuinfo=text)

    dynamic = {"quantization": {"recipe": {"target": "amx", "layer_op": cf.DYNAMIC_INT8}}}
    note = cf.target_note(dynamic, "m/int8", x86("sse2 avx2 fma avx512f"))
    assert "DynamicQuantizeMatMul" in note and "Test CPU" in note and "--target native" in note and "\n" not in note
    for flags in ("avx2 avx512f avx512_vnni", "avx2 avx_vnni", "avx2 amx_tile amx_int8", None):
        assert cf.target_note(dynamic, "m", x86(flags)) is None, flags  # exact kernels, or nothing to tell by
    assert cf.target_note({"quantization": {"recipe": {"target": "avx2"}}}, "m", x86("avx2")) is None
    assert cf.target_note(dynamic, "m", arm(cpuinfo((0x41, 0xD08)), hw())) is None  # NEON's kernel: exact
    assert not cf.facts(machine="x86_64", cpuinfo="").u8s8_saturates


def test_the_cli_on_a_32_bit_arm_python_says_one_line_and_exits_1():
    import subprocess
    import sys

    code = "import platform; platform.machine = lambda: 'armv7l'; import gpt2edge.cli"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert (
        done.stderr.startswith("error: gpt2edge needs a 64-bit ARM (aarch64) Python") and done.stderr.count("\n") == 1
    )

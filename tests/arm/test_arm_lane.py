"""On the aarch64 lane only (scripts/test-aarch64.sh sets GPT2EDGE_LANE_CPU to the QEMU CPU it emulates): the real
platform facts of each emulated CPU, the target `native` picks, the refusal of one it cannot run, the SME guard,
and a folder made for i8mm running on a CPU without it. Skipped elsewhere (tests/arm/test_cpu_facts.py fakes the
same facts on any CPU)."""

from __future__ import annotations

import os
import platform
import re
import warnings
from pathlib import Path

import pytest

LANE_CPU = os.environ.get("GPT2EDGE_LANE_CPU", "")
pytestmark = pytest.mark.skipif(not LANE_CPU, reason="the aarch64 lane's emulated CPUs only")
# what QEMU's HWCAP says each CPU runs, and the target that follows
EXPECTED = {
    "cortex-a72": ("Cortex-A72", "arm64", set(), {"asimddp", "i8mm", "sve", "sme"}),
    "neoverse-n1": ("Neoverse-N1", "arm64-dotprod", {"asimddp"}, {"i8mm", "sve", "sme"}),
    "max": ("QEMU max", "arm64-sve", {"asimddp", "i8mm", "sve", "sme"}, set()),
    "max,sme=off": ("QEMU max", "arm64-sve", {"asimddp", "i8mm", "sve"}, {"sme"}),
}
PARITY = Path(__file__).resolve().parents[2] / "lane-parity"


def expected():
    if LANE_CPU not in EXPECTED:
        pytest.skip(f"no expectations written for QEMU_CPU={LANE_CPU}")
    return EXPECTED[LANE_CPU]


def test_the_emulated_cpu_is_named_probed_and_said_to_be_emulated():
    from gpt2edge.cpu_facts import this_cpu

    name, _, has, lacks = expected()
    cpu = this_cpu()
    assert platform.machine() == "aarch64" and cpu.arm64
    assert cpu.name.startswith(name) and cpu.emulated and "x86" in cpu.emulated
    assert has <= set(cpu.features) and not lacks & set(cpu.features) and "asimd" in cpu.features


def test_native_picks_the_cpus_arm_target_and_refuses_one_it_cannot_run():
    from gpt2edge.quantize.recipe import make_recipe
    from gpt2edge.quantize.targets import ARM_TARGETS, detect

    _, target, _, _ = expected()
    assert detect().target == target and make_recipe("int4", target="native").target == target
    for other in ARM_TARGETS[: ARM_TARGETS.index(target)]:  # the better ones this CPU lacks
        with pytest.raises(Exception, match=f"--target {other} needs .*the probe found"):
            make_recipe("int4", target=other)


def test_sessions_keep_off_kleidiai_exactly_on_sme():
    from gpt2edge.runtime.model.ort_session import kleidiai_off

    assert kleidiai_off(env={}) == ("sme" in expected()[2])


def test_an_i8mm_folder_runs_here_with_a_note_where_i8mm_is_missing():
    from gpt2edge.runtime import Generator

    if not (PARITY / "int4-arm64-i8mm").is_dir():
        pytest.skip("the lane's parity folders are not here")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = Generator(PARITY / "int4-arm64-i8mm", threads=1)
    notes = [str(w.message) for w in caught if "quantized for arm64-i8mm" in str(w.message)]
    assert bool(notes) == ("i8mm" in expected()[3])
    assert len(gen.generate("The quick", max_new_tokens=4, do_sample=False).token_ids) == 4


def test_the_native_sparse_step_is_built_and_vectorised_with_neon():
    """_certify.c's target_clones are x86-only; on aarch64 gcc -O3 vectorises its loops with NEON (baseline there)
    and -ffp-contract=off keeps the sums' rounding x86's (the sparse folder's ids equal x86's: the parity check)."""
    import shutil
    import subprocess

    from gpt2edge.runtime.sparse_head import native

    lib = native._library()
    assert lib is not None, "the native step was not built by pip install"
    if shutil.which("objdump") is None:
        pytest.skip("no objdump in this root")
    code = subprocess.run(["objdump", "-d", lib._name], capture_output=True, text=True, check=True).stdout
    assert re.search(r"\bv\d+\.4s\b", code)  # instructions on 4-lane vectors (NEON's .4s arrangement)


def test_memory_and_caches_read_from_what_arm_linux_exposes():
    """The memory checks read MemAvailable, the cgroup limits and the page size (16 KiB on a Pi 5's kernel) the
    same way on ARM; the caches sysfs shows under qemu-user are the host's, which bench does not report."""
    from gpt2edge.budget.memory import available_bytes
    from gpt2edge.budget.needs import available_memory

    assert available_memory() > 0 and available_bytes() > 0
    assert os.sysconf("SC_PAGE_SIZE") in (4096, 16384, 65536)

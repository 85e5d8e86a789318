#!/usr/bin/env bash
# The aarch64 lane (docs/arm.md): an arm64 Debian root run by qemu-user, the project installed into it, then for each
# emulated CPU the torch-free runtime tests and the parity check of folders made on this x86 host.
#   bash scripts/test-aarch64.sh            build or reuse the root, run the lane
#   bash scripts/test-aarch64.sh --root     only build the root and its venv (the cold part)
#   bash scripts/test-aarch64.sh --run CPU CMD...   this tree installed in the root, CMD run in it (in /src) under
#                                           QEMU_CPU=CPU, e.g. --run neoverse-n1 python scripts/arm_int4_repro.py
# Cold (no root, no wheels) ~9-11 min; warm (root and wheel cache kept) ~2-5 min. Cached under
# ${XDG_CACHE_HOME:-~/.cache}/gpt2edge/aarch64-root and aarch64-pip. GPT2EDGE_ARM_CPUS picks the QEMU CPUs.
# Without root or binfmt_misc it skips with a reason (exit 0); once it can run, any failure fails.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
# bump when the root's recipe below changes: a root with another stamp (or none: a partial build) is rebuilt
RECIPE=1
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/gpt2edge
ROOT=$CACHE/aarch64-root
PIPC=$CACHE/aarch64-pip
CPUS=${GPT2EDGE_ARM_CPUS:-neoverse-n1 cortex-a72 max}
VENV=/opt/gpt2edge-venv
say() { echo "test-aarch64: $*"; }
skip() { say "skipped: $*"; exit 0; }

# 1. what the lane needs from the host: root (chroot, mounts, binfmt), qemu-user-static, mmdebstrap
[ "$(uname -m)" = x86_64 ] || skip "the host is $(uname -m), not x86_64 (on an aarch64 host run pytest directly)"
[ "$(id -u)" = 0 ] || skip "needs root (chroot, mount, binfmt_misc); run as root or see docs/arm.md"
if ! command -v qemu-aarch64-static >/dev/null || ! command -v mmdebstrap >/dev/null \
    || ! command -v update-binfmts >/dev/null; then
    command -v apt-get >/dev/null || skip "qemu-user-static and mmdebstrap are missing and there is no apt-get"
    say "installing qemu-user-static mmdebstrap binfmt-support"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q qemu-user-static mmdebstrap binfmt-support >/dev/null
fi
# 2. binfmt_misc: the kernel hands aarch64 ELF files to qemu (flag F: the interpreter is opened now, so the chroot
# needs no copy of it); a container without the mount right cannot run the lane at all
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
        || skip "binfmt_misc cannot be mounted here (a container without CAP_SYS_ADMIN?)"
fi
if ! grep -qs '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64; then
    update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
fi
grep -qs '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 || skip "qemu-aarch64 could not be registered in binfmt_misc"
say "qemu: $(qemu-aarch64-static --version | head -n1)"

# 3. the arm64 root, built once into a temp folder and renamed (a stopped build never looks finished)
if [ "$(cat "$ROOT/.gpt2edge-root" 2>/dev/null)" != "$RECIPE" ]; then
    say "building the arm64 root (bookworm, ~7 min, ~500 MB) into $ROOT"
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/aarch64-root.new.XXXXXX")
    rmdir "$tmp"   # mmdebstrap wants a missing or empty target
    nice -n 10 mmdebstrap --quiet --arch=arm64 --variant=apt \
        --include=python3-venv,python3-dev,gcc,ca-certificates bookworm "$tmp"
    rm -rf "$ROOT.old"
    [ -e "$ROOT" ] && mv "$ROOT" "$ROOT.old"
    echo "$RECIPE" >"$tmp/.gpt2edge-root"
    mv "$tmp" "$ROOT"
    rm -rf "$ROOT.old"
fi
mkdir -p "$PIPC" "$ROOT/root/.cache/pip" "$ROOT/src"
# pip in the root verifies PyPI with the host's CA bundle (a proxy's CA may be in it); DNS as the host has it
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true

# an aarch64 /proc/cpuinfo for the CPU QEMU emulates: bookworm's QEMU 7.2 passes the host's x86 one through and
# `import onnxruntime` segfaults on it (cpuinfo's parser); the Features line matches QEMU's HWCAP for that CPU
cpuinfo() {
    local part=$1 features=$2 impl=${3:-0x41} n
    for n in 0 1; do
        printf 'processor\t: %s\nBogoMIPS\t: 50.00\nFeatures\t: %s\nCPU implementer\t: %s\n' "$n" "$features" "$impl"
        printf 'CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: %s\nCPU revision\t: 0\n\n' "$part"
    done
}
CPUINFO_DIR=$CACHE/aarch64-cpuinfo
mkdir -p "$CPUINFO_DIR"
cpuinfo 0xd08 "fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid" >"$CPUINFO_DIR/cortex-a72"
cpuinfo 0xd0c "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp" \
    >"$CPUINFO_DIR/neoverse-n1"
cpuinfo 0x051 "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm sb paca pacg dcpodp sve2 sveaes svepmull svebitperm \
svesha3 svesm4 flagm2 frint svei8mm svef32mm svef64mm svebf16 i8mm bf16 dgh rng bti mte sme" 0x00 >"$CPUINFO_DIR/max"

# inroot CPU CMD...: CMD in the root under QEMU_CPU=CPU, in a private mount namespace (the binds vanish with it)
inroot() {
    local cpu=$1
    shift
    local info=$CPUINFO_DIR/${cpu%%,*}
    [ -f "$info" ] || info=$CPUINFO_DIR/neoverse-n1
    unshare -m --propagation private bash -euc '
        R=$1; info=$2; pipc=$3; src=$4; cpu=$5; shift 5
        mount -t proc proc "$R/proc"
        mount --bind "$info" "$R/proc/cpuinfo"
        mount --rbind /dev "$R/dev"
        mount --rbind /sys "$R/sys"
        mount -o remount,bind,ro "$R/sys" 2>/dev/null || true
        mount --bind "$pipc" "$R/root/.cache/pip"
        mount --bind "$src" "$R/src"
        # a fresh /tmp per call, and the gpt2edge caches in it: the parity folders are remade at the same paths each
        # run, and a cache kept in the root from the last run would only say "changed since it was made; rebuilding"
        mount -t tmpfs tmpfs "$R/tmp"
        exec chroot "$R" /usr/bin/env -i HOME=/root PATH='"$VENV"'/bin:/usr/bin:/bin LANG=C.UTF-8 \
            QEMU_CPU="$cpu" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \
            SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PYTHONDONTWRITEBYTECODE=1 \
            OMP_NUM_THREADS=1 GPT2EDGE_LANE_CPU="$cpu" GPT2EDGE_KLEIDIAI="${GPT2EDGE_KLEIDIAI:-}" \
            GPT2EDGE_CACHE_DIR=/tmp/gpt2edge-cache "$@"
    ' inroot "$ROOT" "$info" "$PIPC" "$SRC" "$cpu" "$@"
}

# 4. the venv: the runtime's dependencies and pytest from PyPI's aarch64 wheels (cached in aarch64-pip)
SRC=$CACHE/aarch64-src
mkdir -p "$SRC"
# the requirement list is the venv's stamp: a changed list installs again into the same venv (wheels cached)
REQS="numpy onnxruntime>=1.23 tokenizers>=0.20 click>=8.1 tqdm>=4.60 pytest>=8 setuptools>=77 wheel"
if [ "$(cat "$ROOT/.gpt2edge-venv" 2>/dev/null)" != "$RECIPE $REQS" ]; then
    say "installing the runtime's dependencies into the root's venv"
    [ -x "$ROOT$VENV/bin/python" ] || inroot neoverse-n1 /usr/bin/python3 -m venv "$VENV"
    # shellcheck disable=SC2086  # one word per requirement
    inroot neoverse-n1 "$VENV/bin/python" -m pip install -q --upgrade $REQS
    echo "$RECIPE $REQS" >"$ROOT/.gpt2edge-venv"
fi
[ "${1:-}" = --root ] && { say "root ready: $ROOT"; exit 0; }

# 5. this tree into the root (a copy: pip's build writes into it, and its aarch64 library must not land in the
# worktree), then the project installed editable over it; the native sparse step builds with the root's gcc
HOSTPY=${GPT2EDGE_HOST_PYTHON:-$REPO/.venv/bin/python}
if [ ! -x "$HOSTPY" ] && [ "${1:-}" != --run ]; then
    [ "${CI:-}" = true ] && { say "error: no host Python at $HOSTPY (scripts/setup.sh makes .venv)"; exit 1; }
    skip "no host Python with torch at $HOSTPY to make the folders (run scripts/setup.sh, or set GPT2EDGE_HOST_PYTHON)"
fi
rm -rf "$SRC" && mkdir -p "$SRC"
git ls-files -z --cached --others --exclude-standard | grep -zv '^web/' \
    | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$SRC"
say "installing gpt2edge into the root (builds the native step under emulation)"
inroot neoverse-n1 pip install -q --no-deps --no-build-isolation -e /src
if [ "${1:-}" = --run ]; then
    [ $# -ge 3 ] || { say "error: --run needs a QEMU CPU and a command"; exit 2; }
    cpu=$2
    shift 2
    say "=== QEMU_CPU=$cpu: $*"
    inroot "$cpu" bash -c 'cd /src && exec "$@"' run "$@"
    exit 0
fi

# 6. the folders, made and run here on x86 (greedy ids and top-2 gaps recorded: scripts/aarch64_parity.py)
say "making the parity folders on x86"
PYTHONPATH=$REPO nice -n 10 "$HOSTPY" scripts/aarch64_parity.py make "$SRC/lane-parity" >"$CACHE/parity-make.log" 2>&1 \
    || { cat "$CACHE/parity-make.log"; say "making the parity folders failed"; exit 1; }
# x86's outputs of the 4-bit MatMulNBits reproduction, which each ARM CPU's must equal on the recipes' kernels
PYTHONPATH=$REPO "$HOSTPY" scripts/arm_int4_repro.py --save "$SRC/lane-parity/int4_repro_x86.npz"

# 7. per emulated CPU: the torch-free tests, the SME and int4 reproductions, and the parity check
TESTS="tests/arm/test_cpu_facts.py tests/arm/test_arm_lane.py tests/runtime/test_trim_columns.py"
failed=0
for cpu in $CPUS; do
    say "=== QEMU_CPU=$cpu"
    if ! inroot "$cpu" bash -c "cd /src && nice -n 10 python -m pytest -q -p no:cacheprovider $TESTS \
            && nice -n 10 python scripts/arm_sme_repro.py \
            && nice -n 10 python scripts/arm_int4_repro.py --against lane-parity/int4_repro_x86.npz \
            && nice -n 10 python scripts/aarch64_parity.py check lane-parity"; then
        say "FAILED on $cpu"
        failed=$((failed + 1))
    fi
done
[ "$failed" = 0 ] || { say "$failed of the emulated CPUs failed"; exit 1; }
say "passed on: $CPUS"

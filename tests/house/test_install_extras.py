"""A runtime-only install (`pip install gpt2edge`, no extras) in a real, fresh venv: every command that needs
an extra says which one in one line and exits 1 (no ModuleNotFoundError); generation works there.

The venv is built once for the module (~15-60 s: pip installs numpy, onnxruntime, tokenizers, click, tqdm
through the index pip is configured with, as for the main venv). Deselect with `-m 'not install'`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv holding gpt2edge without extras; returns its bin folder."""
    root = tmp_path_factory.mktemp("runtime-only")
    src = root / "src"  # a copy: pip's in-tree build would leave build/ and *.egg-info in the checkout
    shutil.copytree(ROOT / "gpt2edge", src / "gpt2edge", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=300)
    bin_dir = root / "venv" / "bin"
    p = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(src)],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(),
    )
    assert p.returncode == 0, f"pip install of the runtime-only package failed:\n{p.stderr[-3000:]}"
    return bin_dir


def _env() -> dict[str, str]:
    # the installed package only: no PYTHONPATH pointing back at the checkout (and its torch-full venv)
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def run(bin_dir: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bin_dir / "gpt2edge"), *map(str, args)], capture_output=True, text=True, timeout=300, env=_env()
    )


def test_the_venv_has_no_extras(venv):
    modules = ("torch", "transformers", "onnx", "onnxscript")
    code = f"import importlib.util as u; print([m for m in {modules} if u.find_spec(m)])"
    p = subprocess.run([str(venv / "python"), "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr


@pytest.mark.parametrize(
    "args, extra",
    [
        (["export", "-m", "CKPT", "TMP/out"], "export"),
        (["quantize", "EXPORT", "-o", "TMP/q", "--mode", "int8"], "quantize"),
        (["parity", "EXPORT", "-m", "CKPT"], "export"),
        (["bench", "EXPORT", "--vs-torch", "--prompt-len", "4", "--new-tokens", "2", "--repeat", "1"], "export"),
        (["serve", "EXPORT", "--port", "0"], "serve"),
        (["serve", "EXPORT", "--ray", "--port", "8123"], "cluster"),
    ],
    ids=["export", "quantize", "parity-m", "bench-vs-torch", "serve", "serve-ray"],
)
def test_commands_name_the_extra_they_need(venv, tiny_checkpoint, tiny_export, tmp_path, args, extra):
    paths = {"CKPT": str(tiny_checkpoint), "EXPORT": str(tiny_export), "TMP": str(tmp_path)}
    p = run(venv, *(paths.get(head, head) + sep + tail for head, sep, tail in (a.partition("/") for a in args)))
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    if args[0] == "bench":  # checked where the PyTorch run starts (torch_baseline), after bench's own run
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("error: gpt2edge "), p.stderr
    assert f"needs the {extra} extra" in lines[0] and f"pip install 'gpt2edge[{extra}]'" in lines[0], lines[0]
    assert "Traceback" not in p.stderr and "ModuleNotFoundError" not in p.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "q").exists()


def test_library_entry_raises_the_typed_error(venv, tiny_checkpoint, tmp_path):
    code = (
        "from gpt2edge.errors import MissingExtraError\n"
        "from gpt2edge.export import export_model\n"
        "try:\n"
        f"    export_model({str(tiny_checkpoint)!r}, {str(tmp_path / 'out')!r})\n"
        "except MissingExtraError as e:\n"
        "    print(e)\n"
    )
    p = subprocess.run([str(venv / "python"), "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == 0 and "pip install 'gpt2edge[export]'" in p.stdout, p.stdout + p.stderr


def test_generate_runs_on_the_runtime_only_install(venv, tiny_export):
    p = run(venv, "generate", tiny_export, "-p", "The river", "-n", 5, "--ignore-eos", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"

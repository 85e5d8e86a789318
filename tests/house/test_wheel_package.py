"""The wheel carries the browser runtime (setup.py's build hook, gpt2edge/_web) and `convert --format web` finds
it there; the full install is checked by scripts/test-wheel.sh (CI's wheel lane)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import gpt2edge.convert.web as web

ROOT = Path(__file__).resolve().parents[2]


def _setup_module():
    spec = importlib.util.spec_from_file_location("gpt2edge_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the hook, builds nothing
    return module


@pytest.mark.skipif(not (ROOT / "web" / "node_modules").exists(), reason="web/node_modules: bash scripts/setup.sh")
def test_the_wheel_carries_every_file_convert_copies(monkeypatch):
    monkeypatch.setattr(web, "web_package_dir", lambda: ROOT / "web")
    needed = {p.relative_to(ROOT / "web").as_posix() for p in web._package_files().values()}
    carried = set(_setup_module().web_files())
    assert needed <= carried, needed - carried
    # and the versions the folder's manifest records
    assert {"node_modules/onnxruntime-web/package.json", "node_modules/@huggingface/tokenizers/package.json"} <= carried


def test_installed_package_data_comes_first(tmp_path, monkeypatch):
    package = tmp_path / "gpt2edge"
    (package / "_web").mkdir(parents=True)
    monkeypatch.setattr("importlib.resources.files", lambda name: package)
    assert web.web_package_dir() == ROOT / "web"  # no package.json: not a web runtime, the checkout's is used
    (package / "_web" / "package.json").write_text("{}")
    assert web.web_package_dir() == package / "_web"

"""Build hook: the wheel carries the browser target's static files as package data (gpt2edge/_web), so that
`gpt2edge convert --format web` works from a pip install, not only from a source checkout.

What is copied is what gpt2edge/convert/web.py copies into a web folder (its PAGE, RUNTIME_FILES, ORT_FILES,
TOKENIZERS_FILES and XGRAMMAR_FILES, read from that file, so the lists cannot drift), plus the npm packages'
package.json (their versions go into the folder's manifest) and licenses. The npm packages are the ones
web/package-lock.json pins: when web/node_modules lacks them, or holds other versions, `npm ci` installs them
first (no CDN). Everything else is in pyproject.toml.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
WEB = HERE / "web"
PACKAGES = ("onnxruntime-web", "@huggingface/tokenizers", "@mlc-ai/web-xgrammar")


def _web_py_constants() -> dict:
    """PAGE, RUNTIME_FILES, ORT_FILES, TOKENIZERS_FILES, XGRAMMAR_FILES as gpt2edge/convert/web.py defines them."""
    tree = ast.parse((HERE / "gpt2edge" / "convert" / "web.py").read_text())
    wanted = {"PAGE", "RUNTIME_FILES", "ORT_FILES", "TOKENIZERS_FILES", "XGRAMMAR_FILES"}
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in wanted:
                found[node.targets[0].id] = ast.literal_eval(node.value)
    missing = wanted - set(found)
    if missing:
        raise RuntimeError(f"gpt2edge/convert/web.py no longer defines {sorted(missing)}; update setup.py")
    return found


def web_files() -> list[str]:
    """Paths relative to web/ of every file the wheel's gpt2edge/_web holds."""
    c = _web_py_constants()
    files = ["package.json", c["PAGE"], "serve.py"]
    files += [f"src/{n}" for n in c["RUNTIME_FILES"]]
    files += [f"node_modules/onnxruntime-web/dist/{n}" for n in c["ORT_FILES"]]
    files += [f"node_modules/@huggingface/tokenizers/{n}" for n in c["TOKENIZERS_FILES"]]
    files += [f"node_modules/@mlc-ai/web-xgrammar/{n}" for n in c["XGRAMMAR_FILES"]]
    for pkg in PACKAGES:
        files.append(f"node_modules/{pkg}/package.json")
        files += [f"node_modules/{pkg}/{n}" for n in ("LICENSE",) if (WEB / "node_modules" / pkg / n).is_file()]
    return list(dict.fromkeys(files))


def _pinned_installed() -> bool:
    """web/node_modules holds the versions web/package-lock.json pins, with the files the page needs."""
    lock = json.loads((WEB / "package-lock.json").read_text())["packages"]
    for pkg in PACKAGES:
        meta = WEB / "node_modules" / pkg / "package.json"
        if not meta.is_file() or json.loads(meta.read_text())["version"] != lock[f"node_modules/{pkg}"]["version"]:
            return False
    return all((WEB / f).is_file() for f in web_files())


def ensure_npm_packages() -> None:
    """Install the pinned npm packages with `npm ci` where they are absent or stale."""
    if _pinned_installed():
        return
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            "building gpt2edge's wheel needs the browser runtime's npm packages (web/package-lock.json): install "
            "Node.js 20+ with npm, or run `npm ci` in web/ first"
        )
    subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=WEB, check=True)
    if not _pinned_installed():
        raise RuntimeError("npm ci in web/ did not install the files the page needs (see web/package-lock.json)")


class BuildPyWithWeb(build_py):
    """build_py, then the web runtime and its pinned npm files into gpt2edge/_web (not for editable installs:
    those run from the checkout, where convert finds web/ itself)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        ensure_npm_packages()
        dest = Path(self.build_lib) / "gpt2edge" / "_web"
        for rel in web_files():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(WEB / rel, target)


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import web_files() from it
    setup(cmdclass={"build_py": BuildPyWithWeb})

"""The browser folder's paths. The page's folder.js takes only plain names inside the folder, in every encoded
spelling (web/test/folder.test.mjs, under node); the folder's serve.py answers a directory with 404, never a
listing, and a bad path (a NUL, "..", encoded slashes and backslashes, double encoding, bad UTF-8, a path too
long, an absolute URL, a symlink out) with 400/404/414: always an answer, never a traceback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.support.web_helpers import WEB

needs_node = pytest.mark.skipif(
    not os.environ.get("CI") and shutil.which("node") is None, reason="node is not installed"
)


@needs_node
def test_folder_js_refuses_every_encoded_path_out():
    proc = subprocess.run(["node", "--test", "test/folder.test.mjs"], cwd=WEB, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "# pass 3" in proc.stdout and "# fail 0" in proc.stdout


@pytest.fixture
def served(tmp_path):
    """serve.py in a folder laid out as `convert --format web` writes one (and a secret beside it), started on
    a port the OS picks; yields (port, folder); the server's stderr is checked for tracebacks at the end."""
    folder = tmp_path / "web"
    (folder / "gpt2edge-web").mkdir(parents=True)
    (folder / "vendor" / "ort").mkdir(parents=True)
    shutil.copyfile(WEB / "serve.py", folder / "serve.py")
    (folder / "index.html").write_text("<!doctype html><title>page</title>")
    (folder / "model.onnx").write_bytes(b"\x08\x07graph")
    (folder / "gpt2edge-web" / "page.js").write_text("export {};")
    (folder / "vendor" / "ort" / "ort.wasm.min.mjs").write_text("export {};")
    (tmp_path / "secret.txt").write_text("SECRET")
    (folder / "out").symlink_to(tmp_path)  # a link out of the folder
    proc = subprocess.Popen([sys.executable, str(folder / "serve.py"), "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()  # "serving DIR on http://127.0.0.1:PORT/ ...": the server is listening
        assert "http://127.0.0.1:" in line, line + proc.stderr.read()
        yield int(line.split("http://127.0.0.1:")[1].split("/")[0]), folder
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err[-3000:]


def request(port: int, target: bytes, method: bytes = b"GET") -> tuple[int, bytes]:
    """One raw HTTP/1.0 request (no client-side checks on the target); (status, body) of the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(method + b" " + target + b" HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1."), f"no answer to {target[:80]!r}: the connection was dropped"
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


FILES = {b"/": b"<!doctype", b"/index.html": b"<!doctype", b"/model.onnx": b"\x08\x07graph",
         b"/gpt2edge-web/page.js": b"export", b"/vendor/ort/ort.wasm.min.mjs": b"export",
         b"/model.onnx?v=1": b"\x08\x07graph"}  # fmt: skip

BAD = [
    b"/%00",
    b"/index.html%00",
    b"/%00/../secret.txt",
    b"/..%2fsecret.txt",
    b"/..%2Fsecret.txt",
    b"/gpt2edge-web%2f..%2f..%2fsecret.txt",
    b"/%2e%2e/secret.txt",
    b"/%2E%2e/secret.txt",
    b"/.%2e/secret.txt",
    b"/%252e%252e/secret.txt",
    b"/%252e%252e%252fsecret.txt",
    b"/..%5csecret.txt",
    b"/..\\secret.txt",
    b"/../secret.txt",
    b"/gpt2edge-web/../../secret.txt",
    b"/out/secret.txt",  # through a symlink out of the folder
    b"/%ff",
    b"/%c3%28",
    b"/%ed%a0%80",  # a UTF-8-encoded surrogate
    b"/%e2%82",  # a truncated sequence
    b"/%0d%0aSet-Cookie:%20x=1",
    b"/%7f",
    b"/" + b"a" * 5000,
    b"/" + b"a/" * 3000,
    b"/" + b"a" * 70000,  # past http.server's own 64 KiB request line
    b"//evil.example/secret.txt",
    b"http://evil.example/secret.txt",
    b"secret.txt",
    b"*",
]


def test_serve_py_serves_the_folders_files(served):
    port, _ = served
    for target, start in FILES.items():
        status, body = request(port, target)
        assert status == 200 and body.startswith(start), (target, status, body[:80])
    assert request(port, b"/model.onnx", b"HEAD") == (200, b"")


@pytest.mark.parametrize("target", [b"/gpt2edge-web/", b"/gpt2edge-web", b"/vendor/", b"/vendor/ort/", b"/out/"])
def test_serve_py_lists_no_directory(served, target):
    status, body = request(served[0], target)
    assert status == 404 and b"Directory listing" not in body and b"page.js" not in body, (status, body[:200])


def test_serve_py_answers_every_bad_path_with_a_4xx(served):
    port, _ = served
    for target in BAD:
        status, body = request(port, target)
        assert status in (400, 404, 414), (target[:80], status)
        assert b"SECRET" not in body and b"Traceback" not in body
    # and is still serving
    assert request(port, b"/model.onnx")[0] == 200

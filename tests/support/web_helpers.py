"""Helpers of the browser tests: a loopback static server with the cross-origin isolation headers that also
takes the page's POSTed reports, and a runner for headless Chromium (web/test/browser.mjs)."""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import threading
import urllib.parse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WEB = REPO / "web"
CHROMIUM = Path("/usr/bin/chromium")


class _Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                      ".js": "text/javascript", ".wasm": "application/wasm"}  # fmt: skip
    isolate = True
    reports: dict[str, list] = {}

    def end_headers(self):
        if self.isolate:
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def do_POST(self):  # noqa: N802 (http.server's name)
        path = urllib.parse.urlparse(self.path).path
        n = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(min(n, 1 << 24))
        try:
            self.reports.setdefault(path, []).append(json.loads(body))
        except ValueError:
            self.reports.setdefault(path, []).append({"unparsable": body.decode("utf-8", "replace")})
        self.send_response(204)
        self.end_headers()

    def log_message(self, fmt, *args):  # quiet, but for failed requests (the browser tests print them on failure)
        if len(args) > 1 and str(args[1]).startswith(("4", "5")):
            print("server:", fmt % args)


class StaticServer:
    """Serve `root` on 127.0.0.1 (a free port) from a thread; POSTs are kept in .reports by path."""

    def __init__(self, root: Path, isolate: bool = True):
        handler = type("Handler", (_Handler,), {"isolate": isolate, "reports": {}})
        self.reports = handler.reports
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> StaticServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def job_url(base: str, report: str, prompt: str, **params) -> str:
    """The page's query-string job: index.html?prompt=...&...&report=URL (stop may be a list: repeated)."""
    q = [("prompt", prompt)]
    for k, v in params.items():
        q += [(k, str(x)) for x in v] if isinstance(v, (list, tuple)) else [(k, str(v))]
    q.append(("report", report))
    return base + "index.html?" + urllib.parse.urlencode(q)


def run_browser(
    urls: list[str], timeout_s: float = 120, screenshot: Path | None = None, webgpu: bool = False,
    form: dict | None = None,
) -> list[dict]:
    """Load each URL in headless Chromium until the page is done; one result dict per URL. webgpu: give
    Chromium its software WebGPU adapter (SwiftShader) instead of running without a GPU. form: fill these
    fields (by element id) and click Generate, as a user does."""
    cmd = ["node", str(WEB / "test" / "browser.mjs"), "--timeout", str(int(timeout_s * 1000))]
    if screenshot is not None:
        cmd += ["--screenshot", str(screenshot)]
    if form is not None:
        cmd += ["--form", json.dumps(form)]
    env = {**os.environ, "WEBGPU": "swiftshader" if webgpu else ""}
    proc = subprocess.run(cmd + urls, capture_output=True, text=True, timeout=timeout_s * len(urls) + 60, cwd=WEB,
                          env=env)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"browser.mjs failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]

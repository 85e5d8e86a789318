"""Serve this folder on http://127.0.0.1:PORT/ with the cross-origin isolation headers that onnxruntime-web's
WASM threads need (COOP/COEP). Any static server works; without these headers the page runs on one thread.

    python3 serve.py [PORT] [--host HOST]
"""

import argparse
import functools
import http.server
from pathlib import Path


class Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                      ".js": "text/javascript", ".wasm": "application/wasm"}

    def end_headers(self):
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        super().end_headers()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("port", nargs="?", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args()
    handler = functools.partial(Handler, directory=str(Path(__file__).resolve().parent))
    with http.server.ThreadingHTTPServer((args.host, args.port), handler) as httpd:
        print(f"serving {Path(__file__).resolve().parent} on http://{args.host}:{args.port}/ (Ctrl-C stops)")
        httpd.serve_forever()


if __name__ == "__main__":
    main()

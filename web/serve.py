"""Serve this folder on http://127.0.0.1:PORT/ with the cross-origin isolation headers that onnxruntime-web's
WASM threads need (COOP/COEP). Any static server works; without these headers the page runs on one thread.

    python3 serve.py [PORT] [--host HOST]

Files only: no directory listings (404), and a path that is not a plain name inside the folder (a NUL, "..",
an encoded slash or backslash, a double-encoded escape, bad UTF-8, an absolute URL) is a 400, never a traceback.
"""

import argparse
import functools
import http.server
import re
import sys
import urllib.parse
from pathlib import Path

MAX_PATH = 1024  # characters of the request target: the folder's own names are far shorter
# what a path may hold once decoded: printable characters, no backslash (a Windows separator)
_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


class Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                      ".js": "text/javascript", ".wasm": "application/wasm"}

    def end_headers(self):
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        super().end_headers()

    def send_head(self):
        """The file the path names, or one error status: 400 for a malformed path, 404 for anything else."""
        file = self._file()
        if isinstance(file, tuple):
            self.send_error(*file)
            return None
        try:
            f = open(file, "rb")
        except OSError:
            self.send_error(404, "File not found")
            return None
        try:
            size = Path(file).stat().st_size
            self.send_response(200)
            self.send_header("Content-type", self.guess_type(str(file)))
            self.send_header("Content-Length", str(size))
            self.end_headers()
        except BaseException:
            f.close()
            raise
        return f

    def _file(self):
        """The path as a file inside the folder, or (status, reason)."""
        target = self.path
        if len(target) > MAX_PATH:
            return 400, "Path too long"
        # an origin-form path only: no "http://host/...", no "//host/..."
        if not target.startswith("/") or target.startswith("//"):
            return 400, "Bad path"
        raw = urllib.parse.urlsplit(target).path
        # an encoded "/" or "\" would be a separator only after decoding; a "%" left after decoding is a
        # double-encoded escape some proxy may decode again
        if re.search(r"%(2f|5c)", raw, re.IGNORECASE):
            return 400, "Bad path"
        try:
            path = urllib.parse.unquote(raw, errors="strict")
        except UnicodeDecodeError:
            return 400, "Bad path (not UTF-8)"
        if "%" in path or _BAD_CHARS.search(path):
            return 400, "Bad path"
        parts = path.split("/")[1:]
        if any(p in (".", "..") for p in parts):
            return 400, "Bad path"
        root = Path(self.directory).resolve()
        try:
            file = root.joinpath(*[p for p in parts if p]).resolve()
            # inside the folder (a symlink out is not), and a directory only as its index.html
            if file != root and root not in file.parents:
                return 404, "File not found"
            if file.is_dir():
                file = file / "index.html"
            return file if file.is_file() else (404, "File not found")
        except (OSError, ValueError):  # a name the OS refuses (too long, ...)
            return 404, "File not found"

    def list_directory(self, path):
        self.send_error(404, "File not found")  # never a listing
        return None


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # the client left mid-answer: nothing to report
        super().handle_error(request, client_address)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("port", nargs="?", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args()
    handler = functools.partial(Handler, directory=str(Path(__file__).resolve().parent))
    with Server((args.host, args.port), handler) as httpd:
        host, port = httpd.server_address[:2]  # port 0: the one the OS chose
        print(f"serving {Path(__file__).resolve().parent} on http://{host}:{port}/ (Ctrl-C stops)", flush=True)
        httpd.serve_forever()


if __name__ == "__main__":
    main()

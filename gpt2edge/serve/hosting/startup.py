"""What `gpt2edge serve` does before it imports the server (FastAPI, uvicorn: ~0.7 s on a Zen 3): bind the port,
so that a port in use (or an address this machine lacks) is one `error:` line, not a lost minute and uvicorn's
exit 3; and build the scheduler on a thread, so that ONNX Runtime's session and the KV rows the scheduler
reserves (both built without the GIL) are made while those imports run (benchmarks/README.md, **Cold start**)."""

from __future__ import annotations

import logging
import socket
import sys
import warnings
from typing import TYPE_CHECKING, TextIO

from gpt2edge.errors import ServeError

if TYPE_CHECKING:
    from gpt2edge.runtime.open_model import GraphLoading
    from gpt2edge.serve.config import ServeConfig
    from gpt2edge.serve.scheduling.scheduler import Scheduler


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening address bound now, so that a port in use (or an address this machine lacks) is reported
    before anything is loaded."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ServeError(f"Cannot resolve --host {host!r} ({e.strerror}); pass an address such as 127.0.0.1.") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ServeError(f"Cannot listen on {host}:{port}: {e.strerror}; pass another --port.") from None
    sock.set_inheritable(True)
    return sock


def log_lines() -> None:
    """gpt2edge's own log lines (the JSON access log, load and failure notes) on stderr, one per line, and Python
    warnings (a stale optimized-graph cache, a bad GPT2EDGE_GRAPH_CACHE_BYTES, ...) as one `warning:` line each, as
    the other commands print them; set before the scheduler's build starts, so that its notes have their form too."""
    warnings.showwarning = one_line_warning
    for name in ("gpt2edge.access", "gpt2edge.serve"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s" if name.endswith("access") else "%(levelname)s: "
                                                   "%(message)s"))  # fmt: skip
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False


def one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """warnings.showwarning's replacement: `warning: MESSAGE` on stderr, without the source path and line that
    Python's two-line form adds (a server's operator reads these among the log lines)."""
    try:
        print(f"warning: {message}", file=sys.stderr if file is None else file, flush=True)
    except (OSError, ValueError):  # stderr closed (a daemon's): a warning is never worth an error
        pass


class SchedulerLoading:
    """load_scheduler() of a GraphLoading's folder, run on a thread from construction on; result() is the app's
    `load` (create_app(background=True) calls it once the server has started: it then waits for what is left)."""

    def __init__(self, loading: GraphLoading, config: ServeConfig) -> None:
        from gpt2edge.runtime.open_model import OnThread

        self.loading, self.config = loading, config
        # the CLI waits for the build on its way out (wait()); a second Ctrl-C there must still end it: a daemon
        self._scheduler = OnThread(self._build, "gpt2edge-load-scheduler")
        self._scheduler.start()

    def _build(self) -> Scheduler:
        from gpt2edge.serve.scheduling.continuous import load_scheduler  # on this thread, beside the server's

        options = self.loading.options  # the GraphLoading's own, which Generator(loading=...) checks
        return load_scheduler(
            self.loading.folder.path, self.config, options["device"], options["threads"], self.loading.verify,
            loading=self.loading,
        )  # fmt: skip

    def result(self) -> Scheduler:
        """The scheduler, once built (the build's own error if it failed)."""
        return self._scheduler.result()

    def done(self) -> bool:
        return self._scheduler.done()

    def wait(self) -> None:
        """Return once the build has ended, built or failed, and the graph's load with it (an error path that must
        not leave ONNX Runtime building a session while the process exits)."""
        self._scheduler.wait()
        self.loading.wait()

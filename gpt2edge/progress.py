"""Progress of a long job: a tqdm bar on a terminal, periodic plain lines otherwise.

A bar's carriage returns are noise in a log file or CI output, but silence for minutes (an export tracing a
large model, a quantize report) looks like a hang. Off a terminal, a line like

    export: step 2/5 (tracing to ONNX), 40 s

goes to the stream every PERIOD_S seconds while the job runs (from a daemon thread, so that a single long
step still reports); a job shorter than that prints nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from tqdm import tqdm

PERIOD_S = float(os.environ.get("GPT2EDGE_PROGRESS_S", "30"))  # how often off a terminal


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """tqdm's update / set_postfix_str / clear, as a context manager; `Progress(total, "export")`."""

    def __init__(
        self, total: int, desc: str, unit: str = "step", file=None, period_s: float | None = None, lines: int = 0
    ) -> None:
        """lines: off a terminal, also a line each time another 1/lines of the total is done (at most `lines`),
        whatever the speed: a long job of many units reports by count, not only by the clock."""
        self.file = file if file is not None else sys.stderr
        self.lines = lines
        self.tty = _isatty(self.file)
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file, leave=False, disable=not self.tty)
        self.total, self.desc, self.unit = total, desc, unit
        self.n, self.postfix = 0, ""
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._ticker = None
        period = PERIOD_S if period_s is None else period_s
        if not self.tty and period > 0:
            self._ticker = threading.Thread(target=self._tick, args=(period,), daemon=True, name="gpt2edge-progress")
            self._ticker.start()

    def line(self) -> str:
        """What the periodic line says now."""
        doing = f" ({self.postfix})" if self.postfix else ""
        return f"{self.desc}: {self.unit} {min(self.n + 1, self.total)}/{self.total}{doing}, " + (
            f"{time.monotonic() - self.t0:.0f} s"
        )

    def _tick(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                print(self.line(), file=self.file, flush=True)
            except (OSError, ValueError):  # the stream closed under us: stop reporting, not the job
                return

    def update(self, n: int = 1) -> None:
        before, self.n = self.n, self.n + n
        self.bar.update(n)
        if not self.tty and self.lines > 0 and self.total > 0:
            step = -(-self.total // self.lines)  # units between two count lines
            if self.n // step > before // step:
                self._print(f"{self.desc}: {min(self.n, self.total)}/{self.total} {self.unit}s done, "
                            f"{time.monotonic() - self.t0:.0f} s")  # fmt: skip

    def _print(self, line: str) -> None:
        try:
            print(line, file=self.file, flush=True)
        except (OSError, ValueError):  # the stream closed under us: the job goes on
            pass

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s
        self.bar.set_postfix_str(s)

    def clear(self) -> None:
        self.bar.clear()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=1)
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

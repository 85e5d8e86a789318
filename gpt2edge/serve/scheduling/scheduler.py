"""The scheduler thread: it alone owns the Generator, takes waiting jobs as batches, and runs them one by one.

Requests that arrive while a batch decodes wait in a bounded queue and start together in the next batch
(the runtime's generate() takes a fixed batch, so rows cannot join mid-decode). Within a batch every row
finishes on its own; the batch ends as soon as all its rows are finished or their clients are gone.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

from gpt2edge.serve.config import ServeConfig
from gpt2edge.serve.scheduling.batch import fail, run_batch, take_batch
from gpt2edge.serve.scheduling.jobs import Job
from gpt2edge.serve.scheduling.model_limits import ModelLimits
from gpt2edge.serve.scheduling.rows import serving_rows

FILL_SHARE = 0.05  # a new batch may wait this share of the previous batch's decode time for its rows


class QueueFull(Exception):
    """More requests are waiting than --max-queue allows (the client gets 429)."""


class ServerClosed(Exception):
    """The scheduler is stopping (the client gets 503)."""


@dataclass
class SchedulerStats:
    waiting: int = 0  # requests in the queue
    running: int = 0  # rows of the batch being decoded
    batches: int = 0
    rows_served: int = 0
    largest_batch: int = 0
    rejected: int = 0  # 429s
    dropped_rows: int = 0  # rows whose client left mid-decode (freed at the next step)
    dropped_waiting: int = 0  # queued requests whose client left (never decoded)
    steps: int = 0  # decode steps (continuous batching)
    draining: bool = False  # shutdown has begun: new requests get 503


class Scheduler:
    """submit() from any thread (cheap, never blocks); one daemon thread decodes."""

    slot_files = None  # llama-server's /slots: the continuous scheduler's, on its prefix cache (slot_files.py)

    def __init__(self, generator, config: ServeConfig) -> None:
        self.generator = generator
        self.config = config
        # a --static graph runs at most its batch of rows, each within its cache capacity; memory bounds the rest
        self.n_positions = int(generator.lm.n_positions)
        self.max_rows, self._rows_why = serving_rows(generator, config.max_batch, config.prefix_cache_bytes)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._closing = False
        self._expect = 1  # rows the next batch waits for: the last batch's clients (they resend) + those waiting
        self._last_arrival = 0.0  # time.monotonic() of the latest submit
        self._last_batch_s = 0.0  # how long the previous batch decoded
        self._stats = SchedulerStats()
        # an approximate LM head (sparse-head --mode cluster) is not the model's distribution: every /v1 response
        # and the model card say so (None for every other folder)
        self.head = generator.graph.approximate
        self._thread = threading.Thread(target=self._loop, name="gpt2edge-scheduler", daemon=True)

    @property
    def tokenizer(self):
        return self.generator.tokenizer

    def limits(self) -> ModelLimits:
        vocab = int(self.generator.graph.vocab_size)
        return ModelLimits(self.n_positions, self.max_rows, vocab, self.encode, self._rows_why,
                           self.tokenizer.max_token_bytes(), self.compile)  # fmt: skip

    def compile(self, constraint):
        """A request's constraint compiled for this model (the engine's bounded cache: a repeated one compiles
        once); the engine's refusal raises ConstraintError."""
        from gpt2edge.runtime.constraints.engine import compile_for

        return compile_for(self.generator, constraint)

    def encode(self, prompt: str) -> list[int]:
        """A prompt's token ids; GPT-2 starts an empty one from <|endoftext|>, as the runtime does."""
        return self.generator.tokenizer.encode(prompt) or [int(self.generator.bos_token_id)]

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """Refuse new jobs (ServerClosed: 503) while the queued and running ones go on (a graceful shutdown)."""
        with self._cond:
            self._stats.draining = True

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing or self._stats.draining:
                raise ServerClosed
            if len(self._waiting) >= self.config.max_queue:
                self._stats.rejected += 1
                raise QueueFull
            self._waiting.append(job)
            self._last_arrival = time.monotonic()
            self._cond.notify()

    def stats(self) -> dict:
        with self._cond:
            self._stats.waiting = len(self._waiting)
            self._stats.running = sum(1 for j in self._running for r in j.rows if not r.done)
            return dict(asdict(self._stats), pid=os.getpid())

    def stop(self, timeout: float = 10.0) -> None:
        """Fail waiting and running jobs ("shutting down"), end the current batch, join the thread."""
        with self._cond:
            self._closing = True
            pending = list(self._waiting) + self._running
            self._waiting.clear()
            self._cond.notify()
        fail(pending, "The server shut down before this request finished; retry on another replica or later.",
             "shutting_down")  # fmt: skip
        for job in pending:
            job.cancel()  # the running batch sees every row cancelled at its next step and ends
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while self._run_next():
            pass

    def _run_next(self) -> bool:
        """Run one batch; False once stopping. (A method, so no job outlives its batch in a local.)"""
        jobs = self._next_batch()
        if jobs is None:
            return False
        if not jobs:  # every queued client left during the wait
            return True
        t0 = time.monotonic()
        n = run_batch(self.generator, jobs)
        with self._cond:
            self._last_batch_s = time.monotonic() - t0
            self._running = []
            self._stats.batches += 1
            self._stats.rows_served += n
            self._stats.largest_batch = max(self._stats.largest_batch, n)
            self._stats.dropped_rows += sum(r.dropped for j in jobs for r in j.rows)
            self._expect = min(self.max_rows, n + self._rows_waiting())
        return True

    def _next_batch(self) -> list[Job] | None:
        """Block until jobs wait, let the batch fill, take it.

        A batch starts once it has as many rows as the previous batch had plus those that waited during it
        (closed-loop clients that just got an answer resend within milliseconds: waiting for them merges
        cohorts that would otherwise alternate) and no request arrived for a tenth of batch_wait_ms (a burst
        is still coming in), or when it is full, or after batch_wait_ms (or 5 % of the previous batch's time, if
        longer). A lone client waits only the tenth.
        """
        with self._cond:
            while True:
                if self._closing:
                    return None
                self._drop_cancelled()
                if self._waiting:
                    break
                self._cond.wait()
            expected = self._expect
            quiet = self.config.batch_wait_ms / 1e4
            # waiting up to 5 % of the previous batch's time costs at most 5 % of throughput, and lets a cohort of
            # clients on a busy host (slow to resend) catch up with the rest
            deadline = time.monotonic() + max(self.config.batch_wait_ms / 1e3, FILL_SHARE * self._last_batch_s)
            while not self._closing and (rows := self._rows_waiting()) < self.max_rows:
                now = time.monotonic()
                if now >= deadline or (rows >= expected and now - self._last_arrival >= quiet):
                    break
                until = deadline if rows < expected else min(deadline, self._last_arrival + quiet)
                self._cond.wait(until - now)
            self._drop_cancelled()
            if self._closing or not self._waiting:
                return None if self._closing else []
            self._running = take_batch(self._waiting, self.max_rows, self.n_positions, self.config.deterministic)
            return self._running

    def _rows_waiting(self) -> int:
        return sum(len(j.rows) for j in self._waiting)

    def _drop_cancelled(self) -> None:
        """Jobs whose clients left while queued free their place without decoding anything."""
        gone = sum(j.cancelled for j in self._waiting)
        if gone:
            self._waiting = deque(j for j in self._waiting if not j.cancelled)
            self._stats.dropped_waiting += gone

"""Continuous batching: a request joins the running batch at the next decode step and leaves it when it ends.

The rule, once per decode step: rows whose request ended (or whose client left) free their cache row; waiting
requests are admitted oldest first while their rows fit the free cache rows (a request's n x prompts rows join
together) while their prompt tokens stay within --prefill-tokens (the first always joins), prefilled together
into those rows, and sample their first token; then every live row decodes one token. The prefill budget keeps
a burst of newcomers from stalling the running rows for one long prefill, and staggers their ends, so later
arrivals join a few at a time (a closed-loop burst of 64 equal requests would otherwise run as lockstep cohorts:
next-batch again). So a newcomer waits at most one decode step plus its prefill, not for the whole batch (the next-batch
Scheduler, kept selectable with --scheduler next-batch, makes it wait for every row of the running batch).

Rows are independent: each row is the runtime's own RowDecoder and each request a RowGroup
(runtime/decoding/row_decoder.py: its SamplingParams, processors, constraint, text, stop matcher and finish rule;
one random generator drawn in the order the runtime draws it for that request alone, finished rows included while
any row of it runs). A batched row's log-probs still differ from its run alone in the last bits (its left pad,
int8/int4 kernels: docs/serve.md), so greedy and seeded text can change with the traffic at near-ties; with
--deterministic they cannot (how rows are grouped into a step: grouping.py). This module only schedules; serve's
own part of a token is the OpenAI mapping (batch.advance); the cache rows: gpt2edge.runtime.model.slots.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gpt2edge.errors import Gpt2EdgeError, ServeError
from gpt2edge.runtime.decoding.logprobs import LogprobRecorder
from gpt2edge.runtime.decoding.row_decoder import RowGroup
from gpt2edge.serve.config import ServeConfig
from gpt2edge.serve.scheduling.batch import advance, fail
from gpt2edge.serve.scheduling.grouping import cache_rows, take_aligned
from gpt2edge.serve.scheduling.jobs import Job, Row
from gpt2edge.serve.scheduling.prefix_rows import prefix_rows
from gpt2edge.serve.scheduling.scheduler import Scheduler
from gpt2edge.serve.scheduling.slot_files import SlotFiles

if TYPE_CHECKING:
    from gpt2edge.runtime.open_model import GraphLoading

log = logging.getLogger("gpt2edge.serve")
RESERVED_POSITIONS = 128  # per cache row, allocated and touched at start (more grow on demand)
RETURN_SHARE = 0.05  # rows just freed: admission waits up to this share of a cycle for their clients to return


@dataclass(eq=False)
class _Live:
    """A job while it has rows in the cache: its rows' runtime decoders (one RNG, one constraint, one draw order)."""

    job: Job
    group: RowGroup
    recorder: LogprobRecorder | None
    in_cache: list[bool]  # per row of the job: holds a cache row now
    prompts: list[list[int]]  # per row of the job: its prompt ids (the first positions of its cache row)
    slot_ids: list[int]  # per row of the job: its slot id (/slots; empty without a prefix cache)

    @property
    def running(self) -> bool:
        return any(self.in_cache)


class ContinuousScheduler(Scheduler):
    """Scheduler's interface (submit, start, stop, stats); one thread owns the Generator's graph and a SlotLM."""

    def __init__(self, generator, config: ServeConfig) -> None:
        super().__init__(generator, config)
        # --deterministic: rows batched at aligned left pads (self.align) where this folder's kernels allow it
        self.slots, self.align = cache_rows(generator.graph, self.max_rows, config.deterministic)
        self._isolated = False  # aligned batching: a request whose own rows are not aligned runs with no other
        # the cache's first positions reserved and touched while /health still says "loading" (llama-server and
        # vLLM reserve theirs at start too): fresh rows' page faults cost up to ~7 % of a cold server's first
        # minute at 64 clients (benchmarks/README.md)
        self.slots.reserve(RESERVED_POSITIONS)
        self._cache_rows: list[tuple[_Live, int]] = []  # per cache row: (its job's state, the row's index in the job)
        self._pending: list[int] = []  # per cache row: the token it feeds at the next step
        self._live: list[_Live] = []  # jobs with rows in the cache, in admission order
        self._freed = 0  # cache rows the latest release freed (their clients may be about to send again)
        self._cycle_s = 0.0  # how long the latest join + decode step took
        self.prefix = prefix_rows(self.slots, config.prefix_cache_bytes)  # None: --prefix-cache-bytes 0
        if self.prefix is not None:  # llama-server's /slots on the prefix cache; their files: --slot-save-path
            self.slot_files = SlotFiles(self.prefix.records, self.prefix.cache, generator.lm, config.slot_save_path)

    def _run_next(self) -> bool:
        """One decode step with whatever joins and leaves around it; False once stopping."""
        jobs = self._admit()
        if jobs is None:
            return False
        t0 = time.monotonic()
        try:
            if jobs:
                self._join(jobs)
            if self._cache_rows:
                tokens = np.array(self._pending, dtype=np.int64)
                # the next masks depend on the sampled tokens only: made during the step, all requests' at once
                RowGroup.prefetch_all([(live.group, np.array(live.in_cache)) for live in self._live], len(tokens))
                lp = self.slots.step(tokens)
                self._stats.steps += 1
                self._sample(lp, list(range(len(self._cache_rows))))
        except Gpt2EdgeError as e:
            self._fail_all(str(e))
        except Exception as e:  # the server must stay up: report the failure to these clients only
            log.exception("decode step of %d rows failed", len(self._cache_rows))
            self._fail_all(f"Internal error while decoding ({type(e).__name__}); the server is still running.")
        self._release()
        self._cycle_s = time.monotonic() - t0
        return True

    def _admit(self) -> list[Job] | None:
        """Block until a row is live or a job waits; take the waiting jobs that fit the free rows (oldest first)."""
        with self._cond:
            while True:
                if self._closing:
                    return None
                self._drop_cancelled()
                if self._waiting or self._cache_rows:
                    break
                self._cond.wait()
            self._await_returning()
            jobs = self._joining() if self.align is None else self._joining_aligned()
            self._running.extend(jobs)
            return jobs

    def _joining(self) -> list[Job]:
        """The waiting jobs that join at this step: oldest first while their rows fit the free cache rows and
        their prompt tokens the prefill budget (the first always). Called with the lock held."""
        free, budget, jobs = self.slots.free_rows, self.config.prefill_tokens, []
        while self._waiting and len(self._waiting[0].rows) <= free and (not jobs or budget > 0):
            job = self._waiting.popleft()
            free -= len(job.rows)
            budget -= self._prefill_tokens(job)
            jobs.append(job)
        return jobs

    def _joining_aligned(self) -> list[Job]:
        """_joining under --deterministic's aligned batching (grouping.take_aligned). Called with the lock held."""
        if self.slots.live == 0:
            self._isolated = False
        if self._isolated:
            return []
        jobs, self._isolated = take_aligned(self._waiting, self.slots, self.config.prefill_tokens, self.align)
        return jobs

    def _prefill_tokens(self, job: Job) -> int:
        """What the job's join prefills: its prompt tokens, less those the prefix cache holds."""
        if self.prefix is None:
            return sum(r.prompt_len for r in job.rows)
        return self.prefix.prefill_tokens(job)

    def _await_returning(self) -> None:
        """Rows freed by the last step: wait a moment (at most RETURN_SHARE of a cycle) for as many requests.

        A client whose stream just ended often sends its next request within milliseconds (a chat turn, an agent
        loop, the benchmark's closed loop); admitting before it arrives leaves its row empty for a whole cycle and
        makes it wait for that cycle's prefill and step first. Called with the lock held.
        """
        freed, self._freed = self._freed, 0
        deadline = time.monotonic() + RETURN_SHARE * self._cycle_s
        while not self._closing and len(self._waiting) < min(freed, self.slots.free_rows):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)

    def _join(self, jobs: list[Job]) -> None:
        """Prefill the jobs' rows into free cache rows, then sample their first tokens."""
        gen = self.generator
        first = len(self._cache_rows)
        prompts = []
        width = self.slots.columns.width if self.slots.columns is not None else int(gen.graph.vocab_size)
        for job in jobs:
            params = gen.sampling_params(max_new_tokens=job.max_tokens, **job.sampling.generate_kwargs())
            recorder = None if job.logprobs is None else LogprobRecorder(gen.tokenizer, job.logprobs, 1)
            ids = [self._prompt_ids(job, row) for row in job.rows]
            texts = [row.text for row in job.rows]
            group = RowGroup.start(params, ids, texts, width, self.slots.columns, job.constraint)
            for row, decoder in zip(job.rows, group.rows):
                row.decoder = decoder
            slot_ids = [] if self.prefix is None else self.prefix.records.take(len(job.rows))
            live = _Live(job, group, recorder, [True] * len(job.rows), ids, slot_ids)
            self._live.append(live)
            for i in range(len(job.rows)):
                self._cache_rows.append((live, i))
                self._pending.append(-1)
            prompts += ids
        cached = None if self.prefix is None else self.prefix.lookup(jobs, prompts)
        lp = self.slots.join(prompts, gen.pad_token_id, cached)
        if self.prefix is not None:
            self.prefix.joined(first, prompts)
        with self._cond:
            self._stats.batches += 1
            self._stats.rows_served += len(prompts)
        self._sample(lp, list(range(first, len(self._cache_rows))))
        self._release()  # rows that ended at their first token do not decode another

    def _prompt_ids(self, job: Job, row: Row) -> list[int]:
        """The row's prompt as token ids (GPT-2 starts an empty prompt from <|endoftext|>, as the runtime does)."""
        if job.prompt_ids is not None:
            return list(job.prompt_ids[row.choice // job.n])
        return self.generator.tokenizer.encode(row.prompt) or [int(self.generator.bos_token_id)]

    def _sample(self, lp: np.ndarray, cache_rows: list[int]) -> None:
        """lp[j] scores cache row cache_rows[j]: each job's RowGroup picks its rows' tokens in the runtime's draw
        order (its finished rows, out of the cache, still draw), and each row's RowDecoder takes its token."""
        where = {self._cache_rows[c]: j for j, c in enumerate(cache_rows)}
        for c in cache_rows:
            self._pending[c] = -1
        for live in {self._cache_rows[c][0]: None for c in cache_rows}:  # each job once, in cache order
            try:
                rows = [where.get((live, i)) for i in range(len(live.job.rows))]
                tokens = live.group.choose(lp, rows)
                for i, j in enumerate(rows):
                    if j is not None:
                        self._take(live, i, int(tokens[i]), lp[j : j + 1])
                        self._pending[cache_rows[j]] = int(tokens[i])  # what the row feeds at the next step
            except Gpt2EdgeError as e:  # this job's constraint cannot go on (e.g. no token left): it alone fails
                fail([live.job], str(e))
            except Exception as e:  # the engine's own failure (llguidance raises plain exceptions): it alone fails
                log.exception("a row of a job failed at sampling")
                fail([live.job], f"sampling failed: {type(e).__name__}: {e}")

    def _take(self, live: _Live, i: int, token: int, scores: np.ndarray) -> None:
        """Row i of the job takes its token (scores: its (1, W) log-probs, for the recorded log-probs); the new
        text goes to the client."""
        reason = live.group.push(i, token)
        record = None
        if live.recorder is not None:
            record = live.recorder.record(scores, np.array([token]), [True], self.slots.columns)[0]
            live.recorder.rows[0].clear()  # the row keeps its own records (Row.logprobs)
        row = live.job.rows[i]
        if not row.done and not live.job.cancelled:
            advance(row, reason, record)

    def _release(self) -> None:
        """Free the cache rows of finished rows and of clients that left (the last row moves into the hole)."""
        dropped = freed = 0
        for c in reversed(range(len(self._cache_rows))):
            live, i = self._cache_rows[c]
            row = live.job.rows[i]
            if live.job.cancelled and not row.done:
                row.done = row.dropped = True
                dropped += 1
            if not row.done:
                continue
            if self.prefix is not None:
                self.prefix.leaving(c, live.prompts[i], row.decoder.generated, live.slot_ids[i])
            moved = self.slots.free(c)
            if moved is not None:
                self._cache_rows[c], self._pending[c] = self._cache_rows[moved], self._pending[moved]
            self._cache_rows.pop()
            self._pending.pop()
            live.in_cache[i] = False
            freed += 1
        self._freed += freed
        if self.prefix is not None:
            self.prefix.keep = True
        ended = [live for live in self._live if not live.running]
        if ended:
            self._live = [live for live in self._live if live.running]
        with self._cond:
            self._stats.dropped_rows += dropped
            self._stats.largest_batch = max(self._stats.largest_batch, len(self._cache_rows))
            if ended:
                done = {id(live.job) for live in ended}
                self._running = [j for j in self._running if id(j) not in done]

    def _fail_all(self, message: str) -> None:
        """A failed step: every job in the cache is told, and the cache is emptied."""
        fail([live.job for live in self._live], message)
        if self.prefix is not None:
            self.prefix.keep = False  # the failed step may have left the rows half-written: none is cached
        for c in reversed(range(len(self._cache_rows))):
            self._cache_rows[c][0].job.rows[self._cache_rows[c][1]].done = True

    def stats(self) -> dict:
        out = super().stats()
        with self._cond:
            out["running"] = len(self._cache_rows)
        out.update({f"cache_{k}_s": round(v, 4) for k, v in self.slots.seconds.items()})
        out["cache_relayouts"] = self.slots.relayouts
        out["cache_slots_read"], out["cache_slots_used"] = self.slots.slots_read, self.slots.slots_used
        if self.prefix is not None:
            out.update(self.prefix.stats())
        return out


def load_scheduler(
    model_dir: str | Path, config: ServeConfig, device: str = "cpu", threads: int | None = None,
    verify: bool | str = True, loading: GraphLoading | None = None,
) -> Scheduler:  # fmt: skip
    """Load the folder's Generator and wrap it in the scheduler config.scheduler names. ONNX Runtime's threads
    do not spin between runs: the event loop that parses requests and writes streams needs those cores between
    steps (on 2 cores, spinning halved the tokens/s of either scheduler under HTTP load: benchmarks/README.md).
    loading: the folder's graph already loading with these options and spin=False (`gpt2edge serve` starts it
    before importing the server; Generator's loading=)."""
    from gpt2edge.runtime import Generator

    gen = Generator(model_dir, device=device, threads=threads, verify=verify, spin=False, loading=loading)
    return make_scheduler(gen, config)


def make_scheduler(generator, config: ServeConfig) -> Scheduler:
    """The scheduler config.scheduler names; continuous batching runs a dynamic export on the CPU (a sparse-head
    folder under its full head), and falls back to next-batch with a log line saying why elsewhere (a --static
    folder, CUDA, an approximate sparse head)."""
    if config.scheduler == "continuous":
        why = generator.graph.slot_refusal
        if why is None:
            return ContinuousScheduler(generator, config)
        if config.slot_save_path is not None:  # asked for outright: a log line would leave every save a 501
            raise ServeError(f"--slot-save-path needs continuous batching, which this folder cannot run: {why}.")
        log.warning("continuous batching is off: %s; using the next-batch scheduler", why)
    if config.prefix_cache_bytes:  # only the continuous scheduler's join reuses a prefix: take no memory for it
        log.warning("--prefix-cache-bytes is ignored: the next-batch scheduler has no prefix cache")
        config = replace(config, prefix_cache_bytes=0)
    return Scheduler(generator, config)

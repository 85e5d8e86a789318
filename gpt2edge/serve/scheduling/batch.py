"""Forming a batch from the waiting jobs, and running it on the Generator with one callback per decode step."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpt2edge.errors import Gpt2EdgeError
from gpt2edge.runtime.decoding.row_decoder import RowDecoder
from gpt2edge.serve.scheduling.jobs import Failure, Job, Piece, Row

if TYPE_CHECKING:
    from gpt2edge.runtime.decoding.logprobs import TokenLogprob

log = logging.getLogger("gpt2edge.serve")


class _BatchDone(Exception):
    """Raised from the step callback once every row is finished or cancelled: the batch ends early."""


def take_batch(waiting: deque[Job], max_batch: int, n_positions: int, alone: bool = False) -> list[Job]:
    """Remove and return the oldest job and every later one that can share its batch.

    A job joins when its sampling key matches the oldest job's, its rows fit under max_batch, and the batch's
    longest prompt plus its largest max_tokens still fit the model's positions (rows are left-padded to the
    longest prompt and all decode for the largest max_tokens). Jobs that do not fit wait for the next batch.
    alone (--deterministic): the oldest job only, so that its rows run exactly as the request alone would.
    """
    chosen: list[Job] = []
    rows = longest = most = 0
    for job in list(waiting):
        if chosen and job.key != chosen[0].key:
            continue
        s, m = max(longest, job.max_prompt_len), max(most, job.max_tokens)
        if chosen and (rows + len(job.rows) > max_batch or s + m > n_positions):
            continue  # the oldest job is always taken: if it cannot run, generate() says why
        chosen.append(job)
        rows, longest, most = rows + len(job.rows), s, m
        waiting.remove(job)
        if rows >= max_batch or alone:
            break
    return chosen


def advance(row: Row, reason: str | None, record: TokenLogprob | None = None, new_token: bool = True) -> None:
    """Send what one token added to a row, once its RowDecoder has taken it (the runtime's finish rule:
    runtime/decoding/row_decoder.py): the new text (never half a character, never past a stop string, held back
    while it may start one), with the log-probs of the tokens that start in it, and OpenAI's finish reason once
    the row ended: "length" for max_tokens, "stop" for the rest (end-of-text, a stop id or string, a complete
    grammar). new_token=False: the row ends without one."""
    if new_token:
        row.n_tokens += 1
        if row.job.metrics is not None:
            row.job.metrics.token(row)
    if row.logprobs is not None and record is not None:
        row.logprobs.push(record)
    finish = None if reason is None else "length" if reason == "length" else "stop"
    piece = row.text.take()
    row.sent += len(piece)
    tokens = None
    if row.logprobs is not None:
        tokens = row.logprobs.finish(row.sent) if finish else row.logprobs.take(row.sent)
    if piece or finish:
        row.job.emit(Piece(row.choice, piece, finish, row.n_tokens, tokens))
    row.done = finish is not None


def end_row(row: Row) -> None:
    """A row the runtime ended without a final token for it (interrupted, or failed): what it has, as "stop"."""
    if row.decoder is not None:
        row.decoder.interrupt()
    else:
        row.text.finish()
    advance(row, "stop", new_token=False)


def on_step(rows: Sequence[Row], step) -> None:
    """The Generator's per-step callback: each row's RowDecoder takes its token under the row's own stop strings
    and max_tokens (jobs of one batch differ in those); a cancelled job's rows stop being read."""
    for b, row in enumerate(rows):
        if row.done:
            continue
        if row.job.cancelled:
            row.done = row.dropped = True  # the runtime keeps decoding the row as padding; nobody reads it
            continue
        if not step.active[b]:  # the runtime finished this row without us noticing: end it cleanly
            end_row(row)
            continue
        complete = step.finished[b] == "stop"  # the runtime runs no stop strings here: its "stop" is the grammar
        reason = row.decoder.push(int(step.tokens[b]), complete)
        advance(row, reason, None if step.logprobs is None else step.logprobs[b])
    if all(r.done for r in rows):
        raise _BatchDone


def fail(jobs: Sequence[Job], message: str, code: str = "generation_failed") -> None:
    """Tell every job that still has live rows that it cannot finish; mark its rows done."""
    for job in jobs:
        if not job.finished and not job.cancelled:
            job.emit(Failure(message, code))
        for r in job.rows:
            r.done = True


def run_batch(generator, jobs: Sequence[Job]) -> int:
    """Decode the jobs' rows as one left-padded batch; returns how many rows it had. Never raises."""
    rows = [r for job in jobs for r in job.rows]
    max_new = max(job.max_tokens for job in jobs)
    # the runtime records one N for the batch: the largest asked for; each row keeps the top of its own N
    top_n = max((job.logprobs for job in jobs if job.logprobs is not None), default=None)
    try:
        for job in jobs:  # each row's own finish rule: the job's max_tokens and stop strings on the batch's tokens
            params = generator.sampling_params(max_new_tokens=job.max_tokens, **job.sampling.generate_kwargs())
            for r in job.rows:
                r.decoder = RowDecoder(params, (), r.text, int(generator.graph.vocab_size))
        generator.generate(
            [r.prompt for r in rows],
            max_new_tokens=max_new,
            callback=lambda step: on_step(rows, step),
            logprobs=top_n,
            constraint=jobs[0].sampling.constraint,  # jobs share a batch only with an equal constraint (Job.key)
            **jobs[0].sampling.generate_kwargs(),
        )
    except _BatchDone:
        pass
    except Gpt2EdgeError as e:
        fail(jobs, str(e))
    except Exception as e:  # the server must stay up: report the failure to these clients only
        log.exception("batch of %d rows failed", len(rows))
        fail(jobs, f"Internal error while decoding ({type(e).__name__}); the server is still running.")
    for row in rows:  # a row the runtime ended (e.g. interrupted) without a final step
        if not row.done and not row.job.cancelled:
            end_row(row)
        row.done = True
    return len(rows)

"""One generated row's decoding, shared by every decode loop: generate / stream / sessions / several sequences
(generate.decode_n_tokens), speculative decoding (the tokens it emits) and the server's continuous scheduler.

A RowDecoder owns what one row needs between steps: its SamplingParams, its history (prompt + generated ids, read
by the history processors), OpenAI's penalties / logit_bias / stop_token_ids (RowPenalties), its text
(TextStream: the one stop-string matcher) and the finish rule. A RowGroup is the rows of one call or request:
they share one random generator and one constraint's matchers, and are drawn in the runtime's order (one
uniform per row per step, finished rows included, while any row runs), so a seeded request gets the same tokens
alone (Generator) as beside other traffic (the server), where finished rows have left the batch.

The order on one row's scores at one step (transformers' where it has one):
  penalties and logit_bias (RowPenalties)  ->  transformers' processors (repetition penalty, n-gram and
  bad-word bans, min_new_tokens)  ->  the constraint's mask (disallowed: -inf)  ->  the warpers (temperature,
  top-k, top-p, min-p, typical-p)  ->  argmax, or one draw by inverse CDF.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from gpt2edge.runtime.constraints.rows import ConstrainedRows, prefetch_batch
from gpt2edge.runtime.decoding.row_penalties import RowPenalties
from gpt2edge.runtime.decoding.sampling import greedy_tokens, next_tokens
from gpt2edge.runtime.decoding.sampling_params import SamplingParams
from gpt2edge.runtime.model.columns import Columns
from gpt2edge.runtime.model.tokenizer import TextStream

if TYPE_CHECKING:
    from gpt2edge.runtime.constraints.engine import CompiledConstraint

FINISH_REASONS = ("eos", "stop", "length")  # what push() returns once a row ends ("interrupted": the loops' own)


class RowDecoder:
    """One row: its history, penalties, text and finish rule. push() takes each token it generates."""

    def __init__(
        self,
        params: SamplingParams,
        prompt: Sequence[int],
        text: TextStream,
        width: int,
        columns: Columns | None = None,
    ) -> None:
        self.params, self.text = params, text
        self.seen = np.asarray(prompt, dtype=np.int64)  # prompt + generated ids (history processors read them)
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.ends = frozenset(params.eos_token_id) | frozenset(params.stop_token_ids)  # a stop id ends as EOS
        self.penalties = None
        if params.row_penalties:
            self.penalties = RowPenalties(
                width, columns, presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                logit_bias=params.logit_bias, stop_token_ids=params.stop_token_ids, min_tokens=params.min_new_tokens,
            )  # fmt: skip

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def penalised(self, scores: np.ndarray) -> np.ndarray:
        """(1, W) log-probs -> with the row's penalties and logit_bias (the first step of the module's order)."""
        return scores if self.penalties is None else self.penalties.apply(scores, len(self.generated))

    def push(self, token: int, complete: bool = False) -> str | None:
        """Take the row's next token; `complete`: its grammar accepts nothing more. Returns the finish reason
        once the row ends ("eos": an end token or stop_token_id; "stop": a stop string or a complete grammar;
        "length": max_new_tokens), else None. A finished row ignores further tokens."""
        if self.finish_reason is not None:
            return self.finish_reason
        token = int(token)
        self.generated.append(token)
        if self.penalties is not None:
            self.penalties.push(token)
        if self.params.uses_history:  # repetition penalty, n-gram and multi-token bad-word bans read the ids
            self.seen = np.append(self.seen, token)
        if token in self.ends:
            self.finish_reason = "eos"
        elif self.text.push(token) | complete:  # a stop string appeared, or the grammar is complete
            self.finish_reason = "stop"
        elif len(self.generated) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.text.finish()
        return self.finish_reason

    def interrupt(self) -> None:
        """Ctrl-C: the row keeps what it has."""
        if self.finish_reason is None:
            self.finish_reason = "interrupted"
            self.text.finish()


class RowGroup:
    """The rows of one call (Generator) or one request (the server): one RNG, one constraint, one draw order."""

    def __init__(
        self,
        rows: list[RowDecoder],
        params: SamplingParams,
        rng: np.random.Generator,
        columns: Columns | None = None,
        constraint: CompiledConstraint | None = None,
    ) -> None:
        self.rows, self.params, self.rng, self.columns = rows, params, rng, columns
        self.step = 0  # tokens each row has been given a draw for (its n_generated at the next step)
        ends = tuple(params.eos_token_id) + tuple(params.stop_token_ids)  # allowed only where the grammar accepts
        self.constraint = None if constraint is None else ConstrainedRows(constraint, len(rows), ends, columns)

    @classmethod
    def start(
        cls,
        params: SamplingParams,
        prompts: Sequence[Sequence[int]],
        texts: Sequence[TextStream],
        width: int,
        columns: Columns | None = None,
        constraint: CompiledConstraint | None = None,
    ) -> RowGroup:
        """A fresh group: one RowDecoder per prompt (a prompt repeated for several sequences), seeded from params."""
        rows = [RowDecoder(params, p, t, width, columns) for p, t in zip(prompts, texts, strict=True)]
        return cls(rows, params, np.random.default_rng(params.seed), columns, constraint)

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.rows)

    def active(self) -> np.ndarray:
        """(R,) bool: the rows still generating."""
        return np.array([not r.finished for r in self.rows])

    def prefetch(self, active: np.ndarray | None = None, rows_in_step: int | None = None) -> None:
        """Start the next step's masks in the background (call right before the forward: they depend on the
        tokens only). `active`: the rows that will be sampled (default: the unfinished ones); rows_in_step: the
        rows the forward runs (default: this group's active ones)."""
        if self.constraint is not None:
            active = self.active() if active is None else active
            rows = int(np.count_nonzero(active)) if rows_in_step is None else rows_in_step
            self.constraint.prefetch(active, rows)

    @staticmethod
    def prefetch_all(groups: Sequence[tuple[RowGroup, np.ndarray]], rows_in_step: int) -> None:
        """prefetch() for several groups at once, each with the rows that will be sampled (a server step's
        requests): one background task computes all their masks (constraints/rows.py prefetch_batch)."""
        prefetch_batch([(g.constraint, active) for g, active in groups if g.constraint is not None], rows_in_step)

    def _plain_greedy(self, step: int) -> bool:
        """Greedy with nothing that changes the scores at `step`: the token is the raw scores' argmax."""
        p = self.params
        return (p.greedy and self.constraint is None and not p.row_penalties and not p.uses_history
                and not p.bad_words_ids and step >= p.min_new_tokens)  # fmt: skip

    def choose(self, logprobs: np.ndarray, where: Sequence[int | None] | None = None) -> np.ndarray:
        """Pick the next token of every row. logprobs: (N, W) scores; where[i] is the row of `logprobs` that
        scores row i, or None for a row no longer in the batch (finished; the RNG still draws for it while the
        group runs). where=None: row i is logprobs[i]. Returns (R,) full token ids (-1 for absent rows).

        Rows whose scores are present but that have finished get a token too (ignored, as a finished row of a
        left-padded batch is fed a pad): that keeps the draw order of a call whatever the batch holds."""
        R, step = len(self.rows), self.step
        self.step += 1
        whole = where is None
        where = list(range(R)) if whole else list(where)
        present = np.array([j is not None for j in where])
        if not whole and self._plain_greedy(step):  # nothing to process: each row's argmax, no batch of scores built
            out = np.full(R, -1, dtype=np.int64)
            out[present] = [greedy_tokens(logprobs[j : j + 1], self.columns)[0] for j in where if j is not None]
            return out
        allowed = None
        if self.constraint is not None:  # each unfinished row's grammar: its allowed tokens now
            allowed = self.constraint.masks(present & self.active())
        seen = [r.seen for r in self.rows]
        if whole and not self.params.row_penalties:  # the batch as it is (no copy): the processors vectorised
            return next_tokens(logprobs, self.params, seen, step, self.rng, self.columns, allowed)
        scores = [None if j is None else self.rows[i].penalised(logprobs[j : j + 1]) for i, j in enumerate(where)]
        if present.all():  # the whole group in one call
            return next_tokens(np.concatenate(scores), self.params, seen, step, self.rng, self.columns, allowed)
        out = np.full(R, -1, dtype=np.int64)
        for i, s in enumerate(scores):
            if s is None:  # a finished row that left the batch: its draw, as the call alone makes it
                if not self.params.greedy:
                    self.rng.random()
                continue
            mask = None if allowed is None else allowed[i : i + 1]
            out[i] = next_tokens(s, self.params, [seen[i]], step, self.rng, self.columns, mask)[0]
        return out

    def push(self, i: int, token: int) -> str | None:
        """Feed row i its token: the constraint's matcher, then the row's finish rule (see RowDecoder.push)."""
        row = self.rows[i]
        if row.finished:
            return row.finish_reason
        complete = False
        if self.constraint is not None and int(token) not in row.ends:
            complete = self.constraint.advance(i, int(token))
        return row.push(token, complete)

    def interrupt(self) -> None:
        for r in self.rows:
            r.interrupt()

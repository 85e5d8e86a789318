"""The continuous scheduler's side of the prefix cache (--prefix-cache-bytes): what a join looks up, and what
is remembered, when.

A join looks up each newcomer's longest cached prefix (its last prompt token always runs: its log-probs are
needed) and tells each job its cached prompt tokens (OpenAI's usage.prompt_tokens_details.cached_tokens, once
per prompt as prompt_tokens counts it, not per choice). The prompts are remembered as soon as they are
prefilled, so requests arriving while these decode (many chats under one system prompt) reuse them at once;
a row is remembered again when it leaves, with every token it fed (a chat's next turn resends its answer).
After a failed step nothing is remembered: the rows may be half-written. Each row holds a slot id from join to
leave (slot_records.py: llama-server's /slots, saved and restored by slot_files.py). The cache itself is
gpt2edge.runtime.model.prefix_cache (its own lock: /metrics reads it from another thread).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpt2edge.runtime.model.contract import Rows
from gpt2edge.runtime.model.prefix_cache import BLOCK, PrefixCache
from gpt2edge.serve.scheduling.jobs import Job
from gpt2edge.serve.scheduling.slot_records import SlotRecords


class PrefixRows:
    """The prefix cache of one SlotLM's rows."""

    def __init__(self, slots: Rows, max_bytes: int) -> None:
        self.slots = slots
        self.cache = PrefixCache.for_graph(slots.graph, max_bytes)
        self.keep = True  # False after a failed step, until its rows are released
        self.records = SlotRecords(slots.rows)  # one slot id per cache row a batch can hold

    def lookup(self, jobs: list[Job], prompts: list[list[int]]) -> list[list[np.ndarray]]:
        """Per prompt (the jobs' rows in order), the blocks of its longest cached prefix; sets job.cached_tokens."""
        found = [self.cache.lookup(ids, len(ids) - 1) for ids in prompts]
        at = 0
        for job in jobs:
            job.cached_tokens = sum(len(found[at + r]) * BLOCK for r in range(0, len(job.rows), job.n))
            at += len(job.rows)
        return found

    def prefill_tokens(self, job: Job) -> int:
        """The prompt tokens the job's join would prefill (admission's --prefill-tokens budget counts these)."""
        if job.prompt_ids is None:
            return sum(r.prompt_len for r in job.rows)
        return job.n * sum(len(ids) - self.cache.peek(ids, len(ids) - 1) for ids in job.prompt_ids)

    def joined(self, first: int, prompts: list[list[int]]) -> None:
        """The prompts just prefilled into cache rows first, first + 1, ..."""
        for j, ids in enumerate(prompts):
            self.cache.insert(ids, self.slots.row_kv(first + j))

    def leaving(self, c: int, prompt: list[int], generated: Sequence[int], slot: int = -1) -> None:
        """Cache row c, about to be freed: its prompt and the generated tokens it fed (all but the last); its
        slot id is given back with them (with none after a failed step)."""
        held: list[int] = []
        if self.keep:
            fed = int(self.slots.lengths[c]) - len(prompt)
            held = prompt + list(generated[:fed])
            self.cache.insert(held, self.slots.row_kv(c))
        self.records.give_back(slot, held)

    def stats(self) -> dict[str, int]:
        return {f"prefix_{k}": v for k, v in self.cache.snapshot().items()}


def prefix_rows(slots: Rows, max_bytes: int) -> PrefixRows | None:
    """The scheduler's prefix cache (None when --prefix-cache-bytes is 0)."""
    return PrefixRows(slots, max_bytes) if max_bytes > 0 else None

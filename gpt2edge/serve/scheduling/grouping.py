"""How the continuous scheduler groups rows into a step: its cache rows (one batched run, or with
--deterministic where batching cannot be exact, a run per row) and, for --deterministic's aligned batching,
which waiting jobs may join at this step."""

from __future__ import annotations

import logging
from collections import deque

from gpt2edge.runtime.decoding.solo_rows import SoloRows
from gpt2edge.runtime.model.contract import Graph, Rows
from gpt2edge.runtime.model.row_invariance import row_alignment
from gpt2edge.runtime.model.slots import SlotLM
from gpt2edge.serve.scheduling.jobs import Job

log = logging.getLogger("gpt2edge.serve")


def cache_rows(graph: Graph, rows: int, deterministic: bool) -> tuple[Rows, int | None]:
    """The cache rows, and the left-pad multiple admission must keep (None: any).

    Default: all live rows in one batched run on shared-length cache rows (SlotLM). --deterministic, where a
    probe of this folder finds batched rows exact at aligned left pads (runtime/model/row_invariance.py): the
    same, admitting rows only at aligned pads (take_aligned); where it does not (e.g. DynamicQuantizeMatMul
    layers): each row in a run of its own (SoloRows). Either way no row's numbers depend on the others' count,
    lengths or padding."""
    if not deterministic:
        return SlotLM(graph, rows), None
    why = graph.probe_refusal
    align, why = row_alignment(graph) if why is None else (None, why)
    if align is not None:
        log.info("--deterministic: rows batched at left pads that are multiples of %d (exact on this folder)", align)
        return SlotLM(graph, rows), align
    log.warning("--deterministic: each row runs alone (slower): %s", why)
    return SoloRows(graph, rows), None


def take_aligned(waiting: deque[Job], slots: Rows, budget: int, align: int) -> tuple[list[Job], bool]:
    """Remove and return the waiting jobs that join at this step, and whether the first runs isolated.

    Only jobs whose every row's left pad in the shared length P comes out a multiple of `align` (prompt length
    = P mod align) join, so that each row computes exactly what it computes alone; oldest first, while their
    rows fit the free cache rows and their prompt tokens the prefill budget (the first always). P advances by
    one per step, so a job waits at most align - 1 steps for its turn. Into an empty cache the oldest job sets
    P; a job whose own rows are not congruent joins only an empty cache, and no other joins it until it ends
    (it then runs as it does alone); while it waits, no younger job joins (else steady traffic would keep the
    cache from ever emptying), so it waits at most for the rows in the cache to finish."""
    free, jobs, isolated = slots.free_rows, [], False
    residue = slots.past_len % align if slots.live else None
    for job in list(waiting):
        if len(job.rows) > free or (jobs and budget <= 0):
            break
        lens = {r.prompt_len % align for r in job.rows}
        if len(lens) > 1 and (jobs or residue is not None):
            break  # it needs an empty cache: nothing younger overtakes it, so the cache drains and it joins next
        if len(lens) > 1:
            isolated = True
        elif residue is not None and lens != {residue}:
            continue
        residue = next(iter(lens))
        waiting.remove(job)
        free -= len(job.rows)
        budget -= sum(r.prompt_len for r in job.rows)
        jobs.append(job)
        if isolated:
            break
    return jobs, isolated

"""How many rows a server decodes together: --max-batch, or by default DEFAULT_ROWS when their KV cache fits.

The continuous scheduler's cache rows grow on demand up to the model's whole context, so a server is sized for
that worst case before it serves anything: every row's KV cache over n_positions (two copies on a concat graph)
and its step's log-probs, against the memory this process can still take (gpt2edge.budget.memory).
"""

from __future__ import annotations

import logging

from gpt2edge.budget.memory import SHARE, available_bytes, fmt_bytes
from gpt2edge.errors import ServeError
from gpt2edge.runtime.model.memory_plan import generation_estimate
from gpt2edge.serve.config import DEFAULT_MAX_BATCH as DEFAULT_ROWS

log = logging.getLogger("gpt2edge.serve")

STATIC = " (its static graph's batch)"
MEMORY = " (what this machine's memory holds)"


def serving_rows(generator, max_batch: int | None, prefix_cache_bytes: int = 0) -> tuple[int, str]:
    """(rows, why fewer than asked: "" or STATIC or MEMORY). An explicit max_batch that would not fit is refused
    (ServeError, before any request is taken); the default shrinks to what fits, with a log line. The prefix
    cache's bound (--prefix-cache-bytes) is taken first: refused when it alone does not fit, else the rows get
    what it leaves."""
    avail = available_bytes()
    cache = _prefix_cache_room(prefix_cache_bytes, avail)
    static = generator.lm.batch
    if static is not None:  # a --static graph: its cache is already allocated for its batch
        asked = DEFAULT_ROWS if max_batch is None else max_batch
        return (int(static), STATIC) if static < asked else (asked, "")
    folder, n = generator.folder, int(generator.folder.n_positions)
    per_row = generation_estimate(folder, [[0]], n).total  # one row over the whole context, and its log-probs
    rows = DEFAULT_ROWS if max_batch is None else max_batch
    if avail is None or rows * per_row + cache <= SHARE * avail:
        return rows, ""
    fit = int((SHARE * avail - cache) // per_row)
    need = f"{rows} rows of {n} positions would hold about {fmt_bytes(rows * per_row)} of KV cache and log-probs"
    if cache:
        need += f" (beside the {fmt_bytes(cache)} prefix cache)"
    if max_batch is not None or fit < 1:
        raise ServeError(
            f"--max-batch: {need}, more than the {fmt_bytes(avail)} available; "
            + (f"lower --max-batch to at most {fit}, or free memory." if fit >= 1 else "free memory.")
        )
    log.warning("%s, more than the %s available: serving %d rows (set --max-batch to choose)", need,
                fmt_bytes(avail), fit)  # fmt: skip
    return fit, MEMORY


def _prefix_cache_room(nbytes: int, avail: int | None) -> int:
    """The prefix cache's bound, refused (one line naming it) when it alone exceeds what a plan may take."""
    if nbytes and avail is not None and nbytes > SHARE * avail:
        raise ServeError(
            f"--prefix-cache-bytes: a prefix cache of {fmt_bytes(nbytes)} is more than this machine can hold "
            f"({fmt_bytes(avail)} available, {fmt_bytes(SHARE * avail)} of it for the server's caches); "
            "lower it or pass 0 (off)."
        )
    return nbytes

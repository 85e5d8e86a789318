"""The server's limits and names, checked once at start-up (no FastAPI, no Ray: the CLI imports this cheaply)."""

from __future__ import annotations

from dataclasses import dataclass

from gpt2edge.errors import ServeError

MAX_STOP = 4  # OpenAI's limit on stop sequences per request
SCHEDULERS = ("continuous", "next-batch")
MAX_LOGPROBS = 5  # OpenAI's limit on `logprobs` (the top alternatives reported per token)


@dataclass(frozen=True)
class ServeConfig:
    """What one server (or one Ray Serve replica) accepts.

    max_batch rows decode together (a request of n choices and k prompts is n*k rows); up to max_queue further
    requests wait for the next batch, and past that a request gets 429. batch_wait_ms is the longest a new batch
    waits to fill (to the previous batch's size, and until requests stop arriving for a tenth of it).
    """

    model_name: str
    max_batch: int = 16
    max_queue: int = 128
    max_n: int = 8
    max_body_bytes: int = 1 << 20
    batch_wait_ms: float = 50.0
    scheduler: str = "continuous"  # or "next-batch" (the comparison baseline; see serve/continuous.py)

    def __post_init__(self) -> None:
        # each bound named with the flag that sets it, before any model is loaded
        if not self.model_name:
            raise ServeError("The model name must not be empty; pass --model-name NAME.")
        if self.max_batch < 1:
            raise ServeError(f"--max-batch must be >= 1, got {self.max_batch}.")
        if self.max_queue < 1:  # every request passes through the queue, however briefly
            raise ServeError(f"--max-queue must be >= 1, got {self.max_queue}.")
        if self.max_n < 1:
            raise ServeError(f"--max-n must be >= 1, got {self.max_n}.")
        if self.max_body_bytes < 1024:
            raise ServeError(f"--max-body-kb must be >= 1, got {self.max_body_bytes / 1024:g}.")
        if self.scheduler not in SCHEDULERS:
            raise ServeError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}.")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ServeError(f"--batch-wait-ms must be in [0, 1000], got {self.batch_wait_ms}.")

"""The server's limits and names, checked once at start-up (no FastAPI, no Ray: the CLI imports this cheaply).
Every serve room reads it (api, scheduling, hosting), so it sits beneath them and imports none of them."""

from __future__ import annotations

from dataclasses import dataclass

from gpt2edge.errors import ServeError

MAX_STOP = 4  # OpenAI's limit on stop sequences per request
MAX_LOGPROBS = 5  # OpenAI's limit on `logprobs` (the top alternatives reported per token)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on chat's `top_logprobs`
SCHEDULERS = ("continuous", "next-batch")
# rows decoded together unless --max-batch says otherwise (fewer when memory would not hold their KV cache):
# room for 64 closed-loop clients without a queue; tuning against the CPU's compute-bound point: docs/serve.md
DEFAULT_MAX_BATCH = 64


@dataclass(frozen=True)
class ServeConfig:
    """What one server (or one Ray Serve replica) accepts.

    max_batch rows decode together (a request of n choices and k prompts is n*k rows); up to max_queue further
    requests wait, and past that a request gets 429. scheduler: "continuous" (a request joins the running batch
    at the next decode step) or "next-batch" (it waits for the running batch to end; batch_wait_ms is then the
    longest a new batch waits to fill). deterministic: a request's tokens and log-probs do not depend on what else
    is served (each row runs alone: SoloRows under continuous batching, one request per batch under next-batch).

    Connection limits (uvicorn, serve/hosting/limits.py): a request's headers must arrive within header_timeout_s and
    its body within body_timeout_s (else 408); at most max_connections are open (one more gets 503 and is
    closed); a request head past max_header_bytes gets 431; an idle keep-alive connection is closed after keep_alive_s.
    A stream whose client lets more than max_buffered_events go unread is dropped with an error event. On
    shutdown, running requests get shutdown_timeout_s to finish. api_key: requests need `Authorization: Bearer
    <key>` (401 otherwise); /health and /metrics stay open. A chat template renders for at most
    template_timeout_s (serve/api/chat_template.py: its process, memory budget and output cap).
    """

    model_name: str
    max_batch: int | None = None  # None: 64 rows, fewer when memory would not hold them (scheduling/rows.py)
    max_queue: int = 128
    max_n: int = 8
    max_body_bytes: int = 1 << 20
    batch_wait_ms: float = 50.0
    scheduler: str = "continuous"
    prefill_tokens: int = 256  # continuous: prompt tokens admitted per decode step (the first request always)
    deterministic: bool = False  # every row computed as it would be alone (serve.md, "Rows that do not depend ...")
    max_buffered_events: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 512
    max_header_bytes: int = 16 * 1024
    keep_alive_s: float = 5.0
    shutdown_timeout_s: float = 10.0
    api_key: str | None = None
    chat_template: str | None = None  # a jinja file for /v1/chat/completions, instead of the folder's own
    template_timeout_s: float = 2.0  # the longest one chat-template render may take (serve/api/chat_template.py)
    prefix_cache_bytes: int = 0  # continuous: bytes of earlier prompts' KV kept for reuse (0: off; docs/serve.md)
    slot_save_path: str | None = None  # the folder of /slots/{id}?action=save|restore files (None: refused, 501)

    def __post_init__(self) -> None:
        # each bound named with the flag that sets it, before any model is loaded
        if not self.model_name:
            raise ServeError("The model name must not be empty; pass --model-name NAME.")
        if self.max_batch is not None and self.max_batch < 1:
            raise ServeError(f"--max-batch must be >= 1, got {self.max_batch}.")
        if self.max_queue < 1:  # every request passes through the queue, however briefly
            raise ServeError(f"--max-queue must be >= 1, got {self.max_queue}.")
        if self.max_n < 1:
            raise ServeError(f"--max-n must be >= 1, got {self.max_n}.")
        if self.max_body_bytes < 1024:
            raise ServeError(f"--max-body-kb must be >= 1, got {self.max_body_bytes / 1024:g}.")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ServeError(f"--batch-wait-ms must be in [0, 1000], got {self.batch_wait_ms}.")
        if self.scheduler not in SCHEDULERS:
            raise ServeError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}.")
        if self.prefill_tokens < 1:
            raise ServeError(f"--prefill-tokens must be >= 1, got {self.prefill_tokens}.")
        if self.max_buffered_events < 1:
            raise ServeError(f"max_buffered_events must be >= 1, got {self.max_buffered_events}.")
        for flag, value in (("--header-timeout", self.header_timeout_s), ("--body-timeout", self.body_timeout_s),
                            ("--keep-alive", self.keep_alive_s)):  # fmt: skip
            if not 0 < value <= 3600:
                raise ServeError(f"{flag} must be in (0, 3600] seconds, got {value}.")
        if not 0 <= self.shutdown_timeout_s <= 3600:
            raise ServeError(f"--shutdown-timeout must be in [0, 3600] seconds, got {self.shutdown_timeout_s}.")
        if not 0 < self.template_timeout_s <= 60:
            raise ServeError(f"template_timeout_s must be in (0, 60] seconds, got {self.template_timeout_s}.")
        if self.prefix_cache_bytes < 0:
            raise ServeError(f"--prefix-cache-bytes must be >= 0, got {self.prefix_cache_bytes}.")
        if self.prefix_cache_bytes and self.deterministic:
            # a cached prefix was computed in another batch, at another pad: not the bits the row gets alone
            raise ServeError(
                "--deterministic and --prefix-cache-bytes cannot be combined: a cached prefix's keys and values "
                "were computed beside other rows; drop one of them."
            )
        if self.slot_save_path is not None:
            if not str(self.slot_save_path).strip():
                raise ServeError("--slot-save-path must name a folder, got an empty string.")
            if not self.prefix_cache_bytes or self.scheduler != "continuous":
                # a slot's keys and values are the continuous scheduler's prefix-cache blocks
                raise ServeError("--slot-save-path needs --scheduler continuous and --prefix-cache-bytes > 0 (a "
                                 "saved slot's keys and values are those the prefix cache holds).")  # fmt: skip
        if self.max_connections < 1:
            raise ServeError(f"--max-connections must be >= 1, got {self.max_connections}.")
        if self.max_header_bytes < 1024:
            raise ServeError(f"--max-header-kb must be >= 1, got {self.max_header_bytes / 1024:g}.")
        if self.api_key is not None and (not self.api_key.strip() or not self.api_key.isprintable()):
            raise ServeError("--api-key must be printable and not empty (it is compared with the Bearer token).")
        if self.api_key is not None and not self.api_key.isascii():
            # HTTP header values arrive as bytes (read as latin-1): a non-ASCII key could never be matched
            raise ServeError("--api-key must be ASCII (an HTTP header carries it; a non-ASCII key never matches).")

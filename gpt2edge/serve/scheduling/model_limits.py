"""What the scheduler's model allows one request (serve/api/plan.py checks each request against it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against beside the server's limits: the model's positions, the rows one
    request may take (a static graph's batch) and its vocabulary. encode gives an empty prompt its start token."""

    n_positions: int
    max_rows: int
    vocab_size: int
    encode: Callable[[str], list[int]]
    rows_why: str = ""  # why max_rows is below --max-batch: " (its static graph's batch)", memory
    max_token_bytes: int | None = None  # the most bytes of text one token covers (None: not known)
    compile: Callable[[Any], Any] | None = None  # a runtime Constraint -> compiled for this model (engine cache)

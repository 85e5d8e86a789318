"""Hugging Face Hub access decided up front: honour HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, and check once
whether the hub answers, so an offline machine fails in seconds with one line instead of retrying ~30 s."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from gpt2edge.errors import CheckpointError

# one TCP connect decides whether the hub is reachable
HUB_CONNECT_TIMEOUT_S = 3.0


def hub_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read now (huggingface_hub reads them once, at import)."""
    return any(
        os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _hub_reachable() -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def cache_only(repo_id: str, revision: str | None, filenames: tuple[str, ...]) -> bool:
    """Whether hub id `repo_id` must be read from the local cache only (offline, or the hub unreachable);
    raises CheckpointError when it must but none of `filenames` is cached.

    Decided once, in at most a few seconds, so an offline machine gets one clear error instead of retries."""
    from huggingface_hub import try_to_load_from_cache

    offline = hub_offline()
    if not offline and _hub_reachable():
        return False
    cached = any(isinstance(try_to_load_from_cache(repo_id, f, revision=revision), str) for f in filenames)
    if not cached:
        why = "HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set" if offline else "the Hugging Face Hub is unreachable"
        raise CheckpointError(
            f"'{repo_id}' is not a local folder and could not be fetched from the Hugging Face Hub ({why}: this "
            "machine is offline, and the id is not in the local Hugging Face cache); pass a local checkpoint folder."
        )
    return True

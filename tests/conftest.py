"""Session-wide fixtures: each tiny model is built and exported once and shared (an export takes seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from gpt2edge.export import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(tiny_checkpoint, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def tiny_export(tiny_checkpoint, tmp_path_factory) -> Path:
    from gpt2edge.export import export_model

    out = tmp_path_factory.mktemp("exp") / "tiny"
    export_model(str(tiny_checkpoint), out)
    return out


@pytest.fixture(scope="session")
def tiny_export_all(tiny_checkpoint, tmp_path_factory) -> Path:
    from gpt2edge.export import export_model

    out = tmp_path_factory.mktemp("exp") / "tiny-all"
    export_model(str(tiny_checkpoint), out, head="all")
    return out


@pytest.fixture(scope="session")
def tiny_export_shared(tiny_checkpoint, tmp_path_factory) -> Path:
    from gpt2edge.export import export_model

    out = tmp_path_factory.mktemp("exp") / "tiny-shared"
    export_model(str(tiny_checkpoint), out, kv_cache="shared")
    return out

"""Session-wide fixtures: each tiny model is built and exported once and shared (an export takes seconds)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

# A suite started in the background by a non-interactive shell (`cmd &`, nohup) inherits SIGINT (and SIGHUP)
# ignored, and so would every command the tests start: the Ctrl-C / hang-up tests would then see a program
# that cannot be interrupted. Give the children the dispositions a terminal gives them.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


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

"""GraphLoading (runtime/open_model.py): a folder's graph loading on a thread while the caller imports the decoding
modules (`gpt2edge generate`'s cold start). The Generator it feeds gives the ids and log-probs of one that loads
its own graph; a loading started for other options is refused; errors come as before (the folder's on the
caller's thread, the tokenizer's before the graph's) with no session left building behind them; and the CLI
starts the load before it imports the decoding modules, so that their import costs no wall time."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.runtime.generator import Generator
from gpt2edge.runtime.open_model import GraphLoading

PROMPT = "The quick brown fox"
OPTIONS = dict(device="cpu", threads=1, spin=True)


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpt2edge-load-graph"]


def run(gen: Generator) -> tuple[list[int], np.ndarray]:
    r = gen.generate(PROMPT, max_new_tokens=8, do_sample=False, ignore_eos=True, logprobs=2)
    return r.token_ids, np.array([[t.logprob for t in rec.top_logprobs] for rec in r.logprobs])


@pytest.mark.parametrize("fixture", ["tiny_export", "tiny_export_shared"])
def test_a_generator_on_a_loading_gives_what_its_own_load_gives(fixture, request):
    folder = request.getfixturevalue(fixture)
    own_ids, own_lp = run(Generator(folder, threads=1))
    gen = Generator(folder, threads=1, loading=GraphLoading(folder, True, **OPTIONS))
    ids, lp = run(gen)
    assert ids == own_ids
    np.testing.assert_array_equal(lp, own_lp)
    assert loader_threads() == []


@pytest.mark.parametrize("other", [
    dict(threads=2), dict(verify="full"), dict(spin=False),
])  # fmt: skip
def test_a_loading_started_for_other_options_is_refused(tiny_export, other):
    loading = GraphLoading(tiny_export, True, **OPTIONS)
    kwargs = {"threads": 1, **other}
    with pytest.raises(GenerationError, match="loading= was started for"):
        Generator(tiny_export, loading=loading, **kwargs)
    loading.wait()


def test_a_loading_of_another_folder_is_refused(tiny_export, tiny_export_shared):
    loading = GraphLoading(tiny_export_shared, True, **OPTIONS)
    with pytest.raises(GenerationError, match="loading= was started for"):
        Generator(tiny_export, threads=1, loading=loading)
    loading.wait()


def test_a_missing_folder_is_said_on_the_callers_thread(tmp_path):
    with pytest.raises(ModelFolderError):
        GraphLoading(tmp_path / "nowhere", True, **OPTIONS)
    assert loader_threads() == []  # no thread was started


def test_a_broken_tokenizer_is_said_after_the_load_ended(tiny_export, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_export, folder)
    (folder / "tokenizer.json").write_text("{not json")
    loading = GraphLoading(folder, False, **OPTIONS)
    with pytest.raises(ModelFolderError, match="tokenizer.json"):
        Generator(folder, threads=1, verify=False, loading=loading)
    assert loader_threads() == []


def test_a_graph_that_does_not_load_is_said_by_the_generator(tiny_export, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_export, folder)
    (folder / "model.onnx").write_bytes(b"\x08\x07garbage")
    loading = GraphLoading(folder, False, **OPTIONS)
    with pytest.raises(ModelFolderError, match="ONNX Runtime cannot load"):
        Generator(folder, threads=1, verify=False, loading=loading)
    assert loader_threads() == []


def test_the_cli_starts_the_load_before_it_imports_the_decoding_modules(tiny_export):
    """What makes the overlap: when `generate` starts the load, neither the generator nor the decoding loop has
    been imported (their import then runs while ONNX Runtime builds the session)."""
    code = (
        "import json, sys\n"
        "from gpt2edge.runtime import open_model\n"
        "seen = []\n"
        "real = open_model.GraphLoading.__init__\n"
        "def init(self, *a, **k):\n"
        "    seen.extend(sys.modules)\n"
        "    real(self, *a, **k)\n"
        "open_model.GraphLoading.__init__ = init\n"
        "from gpt2edge.cli import main\n"
        f"args = ['generate', {str(tiny_export)!r}, '-p', 'Hi', '-n', '2', '--greedy']\n"
        "try:\n    main(args, standalone_mode=False)\n"
        "except SystemExit:\n    pass\n"
        "print(json.dumps(sorted(seen)), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    at_start = json.loads(out.stderr.strip().splitlines()[-1])
    assert "gpt2edge.runtime.open_model" in at_start  # the load did start
    late = ("gpt2edge.runtime.generator", "gpt2edge.runtime.decoding.generate", "gpt2edge.runtime.speculative")
    assert [m for m in at_start if m.startswith(late)] == []

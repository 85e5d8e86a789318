"""GraphLoading (runtime/open_model.py): a folder's graph loading on a thread while the caller imports the decoding
modules (`gpt2edge generate`'s cold start). The Generator it feeds gives the ids and log-probs of one that loads
its own graph; a loading started for other options is refused; errors come as before (the folder's on the
caller's thread, the tokenizer's before the graph's) with no session left building behind them; and the CLI
starts the load before it imports the decoding modules, so that their import costs no wall time; `serve` starts it
after binding its port and before importing the server (FastAPI, uvicorn), and serves from it."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest

from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.runtime.generator import Generator
from gpt2edge.runtime.open_model import GraphLoading
from tests.support import python_child

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


def test_a_loading_not_started_checks_the_folder_and_loads_on_start_or_result(tiny_export, tmp_path, monkeypatch):
    loads = []
    real = GraphLoading._load
    monkeypatch.setattr(GraphLoading, "_load", lambda self: (loads.append(1), real(self))[1])
    with pytest.raises(ModelFolderError):  # the folder is checked at construction all the same
        GraphLoading(tmp_path / "nowhere", True, start=False, **OPTIONS)
    loading = GraphLoading(tiny_export, True, start=False, **OPTIONS)
    loading.wait()  # nothing started: returns at once (an error path before start() does not hang)
    assert loads == [] and loader_threads() == []
    loading.start()
    loading.start()  # once only
    gen = Generator(tiny_export, threads=1, loading=loading)
    assert loads == [1] and run(gen)[0] == run(Generator(tiny_export, threads=1))[0]
    lazy = GraphLoading(tiny_export, True, start=False, **OPTIONS)
    assert lazy.result() is not None and loads == [1, 1]  # result() starts a load never started


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


def test_serve_starts_the_load_after_its_port_and_before_the_server_imports_then_serves_from_it(tiny_export):
    """`gpt2edge serve`'s cold start: the load starts once the port is bound (a port in use is said before any
    load) and, with the scheduler's build, before FastAPI, uvicorn and the server's modules are imported, which
    then run beside ONNX Runtime's session build and the KV rows' reservation; the server answers from them."""
    code = (
        "import json, sys\n"
        "from gpt2edge.runtime import open_model\n"
        "real = open_model.GraphLoading.start\n"
        "def start(self):\n"
        "    print('AT-START ' + json.dumps(sorted(sys.modules)), file=sys.stderr, flush=True)\n"
        "    real(self)\n"
        "open_model.GraphLoading.start = start\n"
        "from gpt2edge.serve.hosting import startup\n"
        "build = startup.SchedulerLoading.__init__\n"
        "def init(self, *a):\n"
        "    print('AT-BUILD ' + json.dumps(sorted(sys.modules)), file=sys.stderr, flush=True)\n"
        "    build(self, *a)\n"
        "startup.SchedulerLoading.__init__ = init\n"
        "bind = startup.bind_socket\n"
        "def bound(*a):\n"
        "    print('AT-BIND []', file=sys.stderr, flush=True)\n"
        "    return bind(*a)\n"
        "startup.bind_socket = bound\n"
        "from gpt2edge.cli import main\n"
        f"main(['serve', {str(tiny_export)!r}, '--port', '0', '--model-name', 'tiny', '-t', '1'])\n"
    )
    proc = python_child("-c", code)
    log: list[str] = []
    try:
        seen: dict[str, list[str]] = {}  # the modules imported when the load and the build started
        for line in proc.stderr:
            log.append(line)
            if line.startswith("AT-"):  # the CLI's calls first (result() calls start() again: ignored)
                seen.setdefault(line.split(" ", 1)[0], json.loads(line.split(" ", 1)[1]))
            if "model tiny loaded" in line or "loading the model failed" in line:
                break
        assert list(seen) == ["AT-BIND", "AT-START", "AT-BUILD"], "".join(log)  # the port bound before any load
        assert "model tiny loaded" in log[-1], "".join(log)
        late = ("fastapi", "uvicorn", "starlette", "gpt2edge.serve.hosting.server", "gpt2edge.serve.api")
        for at in seen.values():
            assert [m for m in at if m.startswith(late)] == []
        url = re.search(r"on (http://127\.0\.0\.1:\d+)", proc.stdout.readline()).group(1)
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    assert rc == 0, "".join(log) + proc.stderr.read()


def test_serve_stopped_during_the_load_waits_for_it_then_exits_0(tiny_export):
    """A Ctrl-C while the model still loads (the server already up): the process says it waits, lets the load end
    (ONNX Runtime aborts the process if it exits mid-build) and exits 0."""
    code = (
        "import sys, time\n"
        "from gpt2edge.runtime import open_model\n"
        "real = open_model.GraphLoading._load\n"
        "def slow(self):\n"
        "    time.sleep(3)\n"
        "    graph = real(self)\n"
        "    print('LOAD-DONE', file=sys.stderr, flush=True)\n"
        "    return graph\n"
        "open_model.GraphLoading._load = slow\n"
        "from gpt2edge.cli import main\n"
        f"main(['serve', {str(tiny_export)!r}, '--port', '0', '-t', '1'])\n"
    )
    proc = python_child("-c", code)
    try:
        assert "serving" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)  # the load sleeps 3 s: it is still running
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stopping: waiting for the model load to end" in err and "LOAD-DONE" in err, err

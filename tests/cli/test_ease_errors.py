"""The last tracebacks and misleading messages (issue 21, item 5): each class ends in one `error:` line (CLI) or a
typed error naming the argument (Python API), and extreme values compute what transformers computes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.errors import ArgumentTypeError, GenerationError
from gpt2edge.runtime import Generator, ModelFolder
from gpt2edge.runtime.score import Scorer
from tests.support import cli, one_error_line

REPO = Path(__file__).resolve().parents[2]


def edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    edit(manifest)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


# --- a manifest head that disagrees with its graph ---------------------------------------------------------


@pytest.mark.parametrize(
    "source, head",
    [("tiny_export", "all"), ("tiny_export", "tail"), ("tiny_export_all", "last"), ("tiny_export_all", "tail")],
)
def test_a_manifest_head_unlike_the_graph_is_one_line_in_score_and_generate(request, tmp_path, source, head):
    folder = edited_copy(request.getfixturevalue(source), tmp_path / "m", lambda m: m["graph"].update(head=head))
    text = tmp_path / "t.txt"
    text.write_text("the river rose and the city was quiet then children")
    for method in ("auto", "token-by-token"):
        one_error_line(cli("score", folder, text, "--method", method), f"manifest says head '{head}'", "export")
    one_error_line(cli("generate", folder, "-p", "hi", "-n", "2"), f"manifest says head '{head}'")


# --- a session's full-context reservation -------------------------------------------------------------------


def test_an_absurd_n_positions_refuses_a_session_before_allocating(tiny_export, tmp_path):
    """(The estimate is trust's gpt2edge.budget.memory; this checks the class end to end: CLI line and API error.)"""
    folder = edited_copy(tiny_export, tmp_path / "m", lambda m: m["dims"].update(n_positions=10**15))
    r = CliRunner().invoke(main, ["generate", str(folder), "-i"], input="hello\n")
    one_error_line(r, "A session would hold", "n_positions (1000000000000000)")
    with pytest.raises(GenerationError, match="A session would hold"):
        Generator(folder).session()


def test_a_session_larger_than_free_memory_is_refused(tiny_export, monkeypatch):
    from gpt2edge.budget import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)  # a machine with 1 kB free
    with pytest.raises(GenerationError, match="A session would hold"):
        Generator(tiny_export).session()


# --- beam search: extreme length_penalty -------------------------------------------------------------------


@pytest.mark.parametrize("length_penalty", [-20.0, -4.0, 0.5, 3.0])
def test_extreme_length_penalty_returns_transformers_beams(hf_model, tiny_export, length_penalty):
    import torch

    gen = Generator(tiny_export)
    ids = gen.tokenizer.encode("hello world")
    for n in (3, 5):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]), num_beams=3, num_return_sequences=2, max_new_tokens=n, do_sample=False,
                length_penalty=length_penalty, pad_token_id=0, return_dict_in_generate=True,
            )  # fmt: skip
        lengths = (out.beam_indices != -1).sum(dim=1).tolist()  # each beam's generated length (the rest is pad)
        want = [s[len(ids) : len(ids) + n].tolist() for s, n in zip(out.sequences, lengths)]
        got = gen.generate(
            "hello world", num_beams=3, num_return_sequences=2, max_new_tokens=n, length_penalty=length_penalty,
            folder_defaults=False,
        )  # fmt: skip
        assert [r.token_ids for r in got] == want, (length_penalty, n)
        assert all(r.token_ids for r in got)  # never an empty beam


@pytest.mark.parametrize("length_penalty", [1e308, -1e308, 5e-324, 300.0])
def test_length_penalty_at_the_float_limits_runs_without_overflow_or_warnings(tiny_export, length_penalty):
    gen = Generator(tiny_export)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = gen.generate("hi", num_beams=2, num_return_sequences=2, max_new_tokens=3, length_penalty=length_penalty)
    assert len(got) == 2 and all(r.token_ids for r in got)
    r = cli("generate", tiny_export, "-p", "hi", "-n", "3", "--num-beams", "2", "--length-penalty", length_penalty)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output


def test_tie_order_is_torch_topks():
    import torch

    from gpt2edge.runtime.decoding.tie_order import torch_topk_row

    rng = np.random.default_rng(0)
    for _ in range(400):
        n = int(rng.integers(2, 90))
        k = int(rng.integers(1, n + 1))
        levels = rng.integers(0, int(rng.integers(1, 5)), n).astype(np.float32) * np.float32(-1e9)
        row = levels + (rng.random(n) < 0.3) * rng.integers(-3, 0, n).astype(np.float32)
        want = torch.topk(torch.from_numpy(row), k)[1].numpy()
        assert np.array_equal(torch_topk_row(row, k), want), (row.tolist(), k)


# --- every float option at its extremes: no traceback, no numpy RuntimeWarning ----------------------------

FLOAT_OPTIONS = [
    ["--do-sample", "--temperature"],
    ["--do-sample", "--top-p"],
    ["--repetition-penalty"],
    ["--do-sample", "--min-p"],
    ["--do-sample", "--typical-p"],
    ["--num-beams", "2", "--length-penalty"],
]


@pytest.mark.parametrize("value", ["5e-324", "1e-300", "1e30", "1e308"])
def test_float_options_at_their_extremes_raise_no_runtime_warning(tiny_export, value):
    for option in FLOAT_OPTIONS:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a numpy warning becomes the command's exception
            r = cli("generate", tiny_export, "-p", "hello world", "-n", "4", "--seed", "1", *option, value)
        assert r.exit_code in (0, 2), (option, value, r.output, r.exception)  # 2: out of the option's range
        assert "Warning" not in r.output, (option, value, r.output)


def test_commands_print_no_runtime_warning_under_w_error(tiny_export, tmp_path):
    """-W error::RuntimeWarning turns any numpy warning into a traceback: none may appear."""
    text = tmp_path / "t.txt"
    text.write_text("the river rose and the city was quiet")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (
        ["generate", tiny_export, "-p", "hi", "-n", "4", "--do-sample", "--temperature", "1e-320", "--seed", "0"],
        ["generate", tiny_export, "-p", "hi", "-n", "4", "--repetition-penalty", "1e308", "--num-beams", "2"],
        ["score", tiny_export, text],
    ):
        cmd = [sys.executable, "-W", "error::RuntimeWarning", "-m", "gpt2edge.cli", *map(str, args)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0 and "Warning" not in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


# --- converted folders, full disks, static drafts ---------------------------------------------------------


@pytest.fixture(scope="module")
def ort_folder(tiny_export, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ort") / "tiny-ort"
    r = cli("convert", tiny_export, "-o", out, "--format", "ort")
    assert r.exit_code == 0, r.output
    return out


def test_trim_vocab_on_a_converted_folder_names_its_onnx_parent(ort_folder, tiny_export, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("0 1 2 3")
    r = cli("trim-vocab", ort_folder, "-o", tmp_path / "out", "--keep-ids", ids)
    one_error_line(r, "converted (ort) folder", str(tiny_export))
    assert not (tmp_path / "out").exists()


def _disk_full(*a, **k):
    raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : SaveToOrtFormat Failed to save ORT format model to file")


def test_a_full_disk_during_convert_ort_is_named(tiny_export, tmp_path, monkeypatch):
    import onnxruntime.tools.convert_onnx_models_to_ort as conv

    from gpt2edge.convert import ort_format

    monkeypatch.setattr(conv, "convert_onnx_models_to_ort", _disk_full)
    monkeypatch.setattr(ort_format, "disk_full", lambda path: True)
    r = cli("convert", tiny_export, "-o", tmp_path / "o", "--format", "ort")
    one_error_line(r, "Disk full while writing")
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_a_full_disk_during_random_checkpoint_is_named(tmp_path, monkeypatch):
    """safetensors turns ENOSPC into its own SafetensorError; deleting the partial file frees the space, so the
    disk must be asked before the clean-up."""
    from safetensors import SafetensorError
    from transformers import GPT2LMHeadModel

    from gpt2edge import folder

    def no_room(self, path, *a, **k):
        (Path(path) / "model.safetensors").write_bytes(b"\0" * 1000)
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    calls = []
    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", no_room)
    # full while the partial file is there, free again once it is removed
    monkeypatch.setattr(folder, "disk_full", lambda p: calls.append(p) or len(calls) == 1)
    one_error_line(cli("random-checkpoint", tmp_path / "ck"), "Disk full while writing")
    assert os.listdir(tmp_path) == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 400 kB tmpfs (root only): a real ENOSPC."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("needs root to mount a tiny tmpfs")
    yield mnt
    subprocess.run(["umount", str(mnt)])


def test_a_really_full_disk_is_named_by_random_checkpoint_and_convert(tiny_export, tiny_tmpfs):
    # random-checkpoint estimates its disk need first (gpt2edge.budget.needs), so a disk already full is refused
    # before a byte is written; either way the one line names the disk
    r = cli("random-checkpoint", tiny_tmpfs / "ck")
    one_error_line(r)
    assert "disk" in r.output.lower() and "free" in r.output.lower(), r.output
    one_error_line(cli("convert", tiny_export, "-o", tiny_tmpfs / "o", "--format", "ort"), "Disk full while writing")
    assert os.listdir(tiny_tmpfs) == []


def test_a_static_draft_is_refused_in_cli_terms(tiny_checkpoint, tiny_export, tmp_path, monkeypatch):
    from gpt2edge.export import export_model
    from gpt2edge.runtime.model.folder import ModelFolder as folder_class

    target = tmp_path / "tail"
    export_model(str(tiny_checkpoint), target, head="tail", run_validation=False)
    real_open = folder_class.open

    class StaticView:  # the draft folder as a static export's manifest describes it
        def __init__(self, folder):
            self.path, self.graph = folder.path, type("G", (), {"static": (1, 8, 64)})()

    def open_draft_as_static(path, verify=True):
        folder = real_open(path, verify)
        return StaticView(folder) if Path(path) == Path(tiny_export) else folder

    monkeypatch.setattr(folder_class, "open", open_draft_as_static)
    r = cli("generate", target, "-p", "hi", "-n", "3", "--draft", tiny_export)
    one_error_line(r, "static-shape export", "export the draft without --static")
    assert "gpt2edge.runtime" not in r.output and "load_graph" not in r.output


# --- a session from a second thread -----------------------------------------------------------------------


def test_a_session_busy_in_another_thread_says_so(tiny_export):
    s = Generator(tiny_export).session()
    stream = s.stream("hello", max_new_tokens=50, ignore_eos=True, do_sample=False)
    started = threading.Event()
    release = threading.Event()

    def consume():
        for _ in stream:
            started.set()
            release.wait(30)
            break
        stream.close()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(30)
    try:
        with pytest.raises(GenerationError, match="another thread") as e:
            s.append("more")
        assert "stream" not in str(e.value)
    finally:
        release.set()
        t.join(30)
    own = s.stream("x", max_new_tokens=3, do_sample=False)
    next(own)
    with pytest.raises(GenerationError, match="a stream is still open"):  # the same thread: its own open stream
        s.append("y")
    own.close()
    s.append("z")  # idle again


# --- Python API calls with wrong types ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(tiny_export):
    return Generator(tiny_export), Scorer(ModelFolder.open(tiny_export))


WRONG_TYPES = [
    ("generate(None)", lambda g, s: g.generate(None, max_new_tokens=2), "prompt must be a str or a list of str"),
    ("generate(['a', 5])", lambda g, s: g.generate(["a", 5], max_new_tokens=2), "prompt[1] must be a str"),
    ("generate(5)", lambda g, s: g.generate(5, max_new_tokens=2), "got int 5"),
    ("generate(b'hi')", lambda g, s: g.generate(b"hi", max_new_tokens=2), "decode bytes first"),
    ("stop=123", lambda g, s: g.generate("a", stop=123, max_new_tokens=2), "stop must be a str or a list"),
    ('stop=b"x"', lambda g, s: g.generate("a", stop=b"x", max_new_tokens=2), "stop must be a str or a list"),
    ("stop=[1]", lambda g, s: g.generate("a", stop=["\n", 1], max_new_tokens=2), "each of stop must be a str"),
    ("ban=5", lambda g, s: g.generate("a", ban=5, max_new_tokens=2), "ban must be a str or a list"),
    ("stream(None)", lambda g, s: g.stream(None, max_new_tokens=2), "prompt must be a str"),
    ("stream stop=1", lambda g, s: g.stream("a", stop=1, max_new_tokens=2), "stop must be"),
    ("encode_prompt", lambda g, s: g.encode_prompt(None, 2, False), "prompt must be a str"),
    ("session.append", lambda g, s: g.session().append(None), "text must be a str"),
    ("session.generate", lambda g, s: g.session().generate(5, max_new_tokens=2), "prompt must be a str"),
    ("session stop", lambda g, s: g.session().generate("a", stop=123, max_new_tokens=2), "stop must be"),
    ("session.stream", lambda g, s: g.session().stream(b"a", max_new_tokens=2), "decode bytes first"),
    ("score(None)", lambda g, s: s.score(None), "text must be a str"),
    ("score(bytes)", lambda g, s: s.score(b"abc"), "decode bytes first"),
    ("score max_length", lambda g, s: s.score("a b c d", max_length="4"), "max_length must be an int"),
    ("Scorer(path)", lambda g, s: Scorer(str(s.folder.path)), "Scorer takes a ModelFolder"),
    ("Generator(None)", lambda g, s: Generator(None), "model_dir must be a path"),
    ("ModelFolder.open(5)", lambda g, s: ModelFolder.open(5), "path must be a path"),
    ("export_model(None)", lambda g, s: _api("export", "export_model")(None, "o"), "source must be a path"),
    ("export_model(out=5)", lambda g, s: _api("export", "export_model")("x", 5), "out must be a path"),
    ("make_random_checkpoint(None)", lambda g, s: _api("export", "make_random_checkpoint")(None), "out must be"),
    ("quantize_model(None)", lambda g, s: _api("quantize", "quantize_model")(None, "o", None), "src must be"),
    ("convert_folder(None)", lambda g, s: _api("convert", "convert_folder")(None, "o", "ort"), "src must be"),
    ("trim_vocab(None)", lambda g, s: _api("trim.handler", "trim_vocab")(None, "o"), "src must be a path"),
    ("compare_folders text=5", lambda g, s: _api("quality", "compare_folders")("a", "b", text=5), "text must be"),
]


def _api(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(f"gpt2edge.{module}"), name)


@pytest.mark.parametrize("name, call, message", WRONG_TYPES, ids=[w[0] for w in WRONG_TYPES])
def test_python_api_wrong_types_raise_a_type_error_naming_the_argument(api, name, call, message):
    with pytest.raises(TypeError, match=None) as e:
        call(*api)
    assert isinstance(e.value, ArgumentTypeError) and message in str(e.value), str(e.value)


# --- Ctrl-C during start-up; a closed stdout ---------------------------------------------------------------


def started_importing(pid: int) -> None:
    """Wait until the process has loaded numpy: gpt2edge.cli's heavy imports have begun, after its guard."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if "numpy" in Path(f"/proc/{pid}/maps").read_text():
                return
        except OSError:
            return  # no /proc (or the process ended): send the signal anyway
        time.sleep(0.005)


def test_ctrl_c_during_start_up_exits_130_without_a_traceback(tiny_export, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    text = tmp_path / "t.txt"
    text.write_text("the river rose")
    commands = {
        "convert": ["convert", tiny_export, "-o", tmp_path / "o", "--format", "ort"],
        "generate": ["generate", tiny_export, "-p", "hi", "-n", "100"],
        "score": ["score", tiny_export, text],
        "serve": ["serve", tiny_export, "--port", "0"],
    }
    for delay in (0.0, 0.3):
        for name, args in commands.items():
            p = subprocess.Popen(
                [sys.executable, "-m", "gpt2edge.cli", *map(str, args)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
            )  # fmt: skip
            started_importing(p.pid)  # the interpreter's own start (site) comes before any gpt2edge code
            time.sleep(delay)
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=60)
            # 0: it had finished already; -2: the signal came as the interpreter exited (the shell says 130 too)
            assert p.returncode in (130, 0, -signal.SIGINT), (name, delay, p.returncode, err)
            assert "Traceback" not in err and "Error" not in err, (name, delay, err)
            if p.returncode == 130:
                assert err.strip().splitlines()[-1] == "[interrupted]", err
    assert not (tmp_path / "o").exists()


def test_a_closed_stdout_exits_non_zero(tiny_export):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "gpt2edge.cli", "generate", str(tiny_export), "-p", "hi", "-n", "3"]
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, timeout=120,
                       preexec_fn=lambda: os.close(1))  # fmt: skip
    assert p.returncode == 1 and "stdout is closed" in p.stderr and "Traceback" not in p.stderr, p.stderr
    full = subprocess.run(cmd, stdout=open(os.devnull if not os.path.exists("/dev/full") else "/dev/full", "w"),
                          stderr=subprocess.PIPE, text=True, env=env, timeout=120)  # fmt: skip
    if os.path.exists("/dev/full"):
        assert full.returncode == 1 and "No space left" in full.stderr and "Traceback" not in full.stderr


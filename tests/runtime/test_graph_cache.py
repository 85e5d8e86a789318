"""The optimized-graph cache: a second start loads the graph the first one optimized and gives the same ids and
log-probs as a fresh session; an entry that is stale (folder changed), from another ONNX Runtime or CPU,
truncated, tampered, or that does not load is said in one line and rebuilt; a lying record is caught by
verify="full"; an unwritable cache directory only costs the optimization; the folder is never written."""

from __future__ import annotations

import io
import json
import os
import shutil
import time
import warnings

import numpy as np
import pytest

from gpt2edge.manifest import verified
from gpt2edge.quantize import make_recipe, quantize_model
from gpt2edge.runtime.generator import Generator
from gpt2edge.runtime.model import graph_cache
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.lm import OrtGraph

PROMPT = "The quick brown fox"


def private_copy(source, tmp_path, monkeypatch):
    """A private copy of an export (older than the settle time) and a cache directory of this test's own."""
    monkeypatch.setenv("GPT2EDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(verified, "SETTLE_NS", 50_000_000)
    out = tmp_path / "model"
    shutil.copytree(source, out)
    time.sleep(0.1)
    return out


@pytest.fixture
def folder(tiny_export, tmp_path, monkeypatch):
    """A private copy of the tiny export, with a cache directory of this test's own."""
    return private_copy(tiny_export, tmp_path, monkeypatch)


def entry_dir(folder) -> os.PathLike:
    """The one entry the tests' loads make (its name: the folder's graph path and the session options)."""
    (d,) = (verified.cache_root() / "graphs").iterdir()
    return d


def load(folder, verify="fast"):
    """An OrtGraph of the folder and the one-line warnings its load gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = OrtGraph(ModelFolder.open(folder, verify=verify), threads=1)
    return graph, [str(w.message) for w in caught if "optimized graph" in str(w.message)]


def run(folder, cache="1"):
    """Greedy ids and their log-probs from a fresh Generator (GPT2EDGE_GRAPH_CACHE as given)."""
    old = os.environ.get("GPT2EDGE_GRAPH_CACHE")
    os.environ["GPT2EDGE_GRAPH_CACHE"] = cache
    try:
        r = Generator(folder, threads=1).generate(
            PROMPT, max_new_tokens=12, do_sample=False, ignore_eos=True, logprobs=3
        )
    finally:
        if old is None:
            del os.environ["GPT2EDGE_GRAPH_CACHE"]
        else:
            os.environ["GPT2EDGE_GRAPH_CACHE"] = old
    return r.token_ids, np.array([[t.logprob for t in rec.top_logprobs] for rec in r.logprobs])


def used_cache(graph) -> bool:
    """Whether the session was made from the cached graph (its model path lies under the cache root)."""
    return graph.session._model_path.startswith(str(verified.cache_root()))


@pytest.fixture(scope="module")
def kinds(tiny_export, tiny_export_shared, tmp_path_factory):
    """The graph kinds a CPU session caches: fp32 (both KV caches), int8 and int4 (MatMulNBits)."""
    root = tmp_path_factory.mktemp("cache-kinds")
    out = {"fp32": tiny_export, "fp32-shared": tiny_export_shared}
    for mode in ("int8", "int4"):
        quantize_model(tiny_export, root / mode, make_recipe(mode), report=False, log=io.StringIO())
        out[mode] = root / mode
    return out


@pytest.mark.parametrize("kind", ["fp32", "fp32-shared", "int8", "int4"])
def test_second_start_loads_the_cached_graph_with_identical_outputs(kinds, kind, tmp_path, monkeypatch):
    folder = private_copy(kinds[kind], tmp_path, monkeypatch)
    fresh_ids, fresh_lp = run(folder, cache="0")
    assert not (verified.cache_root() / "graphs").exists()  # GPT2EDGE_GRAPH_CACHE=0: nothing saved
    first_ids, first_lp = run(folder)  # optimizes and saves
    d = entry_dir(folder)
    assert sorted(p.name for p in d.iterdir()) == ["model.onnx", "model.onnx.data", "record.json"]
    graph, said = load(folder)
    assert used_cache(graph) and said == []
    cached_ids, cached_lp = run(folder)
    assert cached_ids == first_ids == fresh_ids
    np.testing.assert_array_equal(cached_lp, fresh_lp)
    np.testing.assert_array_equal(first_lp, fresh_lp)


def test_a_tampered_int4_entry_is_caught_by_full_verify_and_rebuilt(kinds, tmp_path, monkeypatch):
    """The fp32 tests below, on a MatMulNBits entry: a byte flipped under a forged record is caught by --verify,
    and the rebuilt entry gives the fresh session's ids and log-probs."""
    folder = private_copy(kinds["int4"], tmp_path, monkeypatch)
    fresh_ids, fresh_lp = run(folder, cache="0")
    run(folder)
    flip_and_forge(entry_dir(folder))
    graph, said = load(folder, verify="full")
    assert len(said) == 1 and "does not match the sha256" in said[0] and not used_cache(graph)
    ids, lp = run(folder)  # the rebuilt entry
    assert used_cache(load(folder)[0]) and ids == fresh_ids
    np.testing.assert_array_equal(lp, fresh_lp)


def test_the_folder_is_never_written(folder):
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    os.chmod(folder, 0o555)  # read-only media (root may still write: the listing below is the check)
    try:
        load(folder)
        graph, _ = load(folder)
    finally:
        os.chmod(folder, 0o755)
    assert used_cache(graph)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_a_changed_folder_rebuilds_its_entry(folder):
    load(folder)
    onnx = folder / "model.onnx"
    st = onnx.stat()
    os.utime(onnx, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # same bytes, another mtime: the source changed
    graph, said = load(folder)
    assert len(said) == 1 and "changed since it was made" in said[0] and "rebuilding" in said[0]
    assert not used_cache(graph)
    graph, said = load(folder)  # rebuilt for the folder as it is now
    assert used_cache(graph) and said == []


@pytest.mark.parametrize(("part", "value", "reason"), [
    ("onnxruntime", "1.0.0", "another ONNX Runtime version"),
    ("cpu", {"machine": "x86_64", "name": "other", "flags": "sse2"}, "another CPU"),
])  # fmt: skip
def test_an_entry_for_another_runtime_or_cpu_is_rebuilt(folder, part, value, reason):
    load(folder)
    rec_path = entry_dir(folder) / "record.json"
    rec = json.loads(rec_path.read_text())
    rec["key"][part] = value
    rec_path.write_text(json.dumps(rec))
    graph, said = load(folder)
    assert len(said) == 1 and reason in said[0] and not used_cache(graph)
    assert json.loads((entry_dir(folder) / "record.json").read_text())["key"][part] != value


def test_a_truncated_or_rewritten_entry_is_rebuilt(folder):
    load(folder)
    data = entry_dir(folder) / "model.onnx.data"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    graph, said = load(folder)
    assert len(said) == 1 and "model.onnx.data changed since it was written" in said[0] and not used_cache(graph)
    ids, lp = run(folder)  # the rebuilt entry gives the fresh session's values
    fresh_ids, fresh_lp = run(folder, cache="0")
    assert ids == fresh_ids
    np.testing.assert_array_equal(lp, fresh_lp)


def flip_and_forge(d, name="model.onnx.data"):
    """Flip a byte of a cached file and rewrite its record's stat fields to match: a record that lies."""
    path = d / name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    rec = json.loads((d / "record.json").read_text())
    rec["files"][name].update(graph_cache._stat(path))
    (d / "record.json").write_text(json.dumps(rec))


def test_a_lying_record_is_caught_by_full_verify(folder):
    load(folder)
    flip_and_forge(entry_dir(folder))
    graph, said = load(folder)
    assert used_cache(graph) and said == []  # the fast check trusts stat (the docs say so)
    graph, said = load(folder, verify="full")
    assert len(said) == 1 and "does not match the sha256" in said[0] and not used_cache(graph)


def test_an_entry_that_does_not_load_is_said_and_rebuilt(folder):
    load(folder)
    d = entry_dir(folder)
    (d / "model.onnx").write_bytes(b"\x08not a protobuf")
    rec = json.loads((d / "record.json").read_text())
    rec["files"]["model.onnx"].update(graph_cache._stat(d / "model.onnx"))
    (d / "record.json").write_text(json.dumps(rec))
    graph, said = load(folder)
    assert len(said) == 1 and "does not load" in said[0] and not used_cache(graph)
    graph, said = load(folder)
    assert used_cache(graph) and said == []


def test_a_garbage_record_is_rebuilt(folder):
    load(folder)
    (entry_dir(folder) / "record.json").write_text("[1, 2")
    graph, said = load(folder)
    assert len(said) == 1 and "not one of gpt2edge's" in said[0] and not used_cache(graph)


def test_an_unwritable_cache_directory_only_costs_the_optimization(folder, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GPT2EDGE_CACHE_DIR", str(blocker / "cache"))  # under a file: mkdir fails, even as root
    graph, said = load(folder)
    assert not used_cache(graph) and said == []
    ids, lp = run(folder)
    fresh_ids, fresh_lp = run(folder, cache="0")
    assert ids == fresh_ids
    np.testing.assert_array_equal(lp, fresh_lp)


@pytest.mark.parametrize(
    "record",
    [{"key": [], "files": {}}, {"key": {}, "files": {"model.onnx": 3, "model.onnx.data": 4}}, [1, 2], "text"],
    ids=["key-a-list", "files-not-records", "a-list", "a-string"],
)
def test_a_record_of_another_shape_is_said_and_rebuilt(folder, record):
    """Valid JSON that is not our record must not stop the model loading on every start."""
    load(folder)
    (entry_dir(folder) / graph_cache.RECORD_NAME).write_text(json.dumps(record))
    _, said = load(folder)
    assert len(said) == 1 and "not one of gpt2edge's" in said[0] and "rebuilding" in said[0], said
    _, said = load(folder)  # rebuilt: the next start uses it quietly
    assert said == []


def test_a_save_onnx_runtime_cannot_write_still_loads_the_model(folder, monkeypatch):
    """A full disk, a quota or a cleaner removing the temp folder makes ORT's save fail: the model still loads,
    uncached, with one line saying so."""
    real = graph_cache.tempfile.mkdtemp

    def vanishing(**kw):  # the temp folder is gone by the time ONNX Runtime writes into it
        d = real(**kw)
        shutil.rmtree(d)
        return d

    monkeypatch.setattr(graph_cache.tempfile, "mkdtemp", vanishing)
    graph, said = load(folder)
    assert len(said) == 1 and "could not be cached" in said[0], said
    assert graph.session is not None
    assert not (verified.cache_root() / "graphs").exists() or not any(
        p.name == graph_cache.RECORD_NAME for p in (verified.cache_root() / "graphs").rglob("*")
    )


def test_a_graph_rewritten_with_its_mtime_kept_is_a_change(folder):
    """cp -p / rsync -a keep the mtime; the inode or ctime still change: the entry is not reused."""
    load(folder)
    graph_file = next(p for p in folder.iterdir() if p.suffix == ".onnx")
    st = os.stat(graph_file)
    data = graph_file.read_bytes()
    graph_file.unlink()
    graph_file.write_bytes(data)  # the same bytes, a new inode
    os.utime(graph_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    _, said = load(folder)
    assert len(said) == 1 and "changed since it was made" in said[0], said


def entries() -> set[str]:
    root = verified.cache_root() / "graphs"
    return {p.name for p in root.iterdir()} if root.exists() else set()


def test_the_cache_keeps_the_recently_used_entries_within_its_limit(folder, tmp_path, monkeypatch):
    # three folders' entries, each used in turn; A used again (its record touched) before C is written: with room
    # for two entries, C's write removes B, the least recently used, and keeps A and C
    copies = {"A": folder}
    for name in ("B", "C"):
        copies[name] = tmp_path / name
        shutil.copytree(folder, copies[name])
    time.sleep(0.1)  # older than the settle time
    names = {}
    for name in ("A", "B"):
        before = entries()
        assert not used_cache(load(copies[name])[0])
        (names[name],) = entries() - before
        time.sleep(0.05)  # distinct record mtimes
    size = graph_cache._bytes(verified.cache_root() / "graphs" / names["A"])
    monkeypatch.setenv("GPT2EDGE_GRAPH_CACHE_BYTES", str(2 * size + size // 2))
    assert used_cache(load(copies["A"])[0])  # a use: A is now the most recent of the two
    time.sleep(0.05)
    before = entries()
    load(copies["C"])
    (names["C"],) = entries() - before
    assert entries() == {names["A"], names["C"]}
    monkeypatch.setenv("GPT2EDGE_GRAPH_CACHE_BYTES", "1")  # smaller than any entry: the one just written stays
    shutil.rmtree(verified.cache_root() / "graphs" / names["A"])
    load(copies["A"])
    assert entries() == {names["A"]}


def test_entries_of_deleted_folders_and_interrupted_saves_are_pruned(folder, tmp_path):
    gone = tmp_path / "gone"
    shutil.copytree(folder, gone)
    time.sleep(0.1)
    load(gone)
    (gone_entry,) = entries()
    away = tmp_path / "away"
    shutil.copytree(folder, away)
    time.sleep(0.1)
    load(away)
    (away_entry,) = entries() - {gone_entry}
    shutil.rmtree(gone)
    shutil.rmtree(away)
    root = verified.cache_root() / "graphs"
    old = time.time() - graph_cache.STALE_BUILD_S - 60
    os.utime(root / gone_entry / graph_cache.RECORD_NAME, (old, old))  # unused for over a day; away's is recent
    stale, fresh = root / ".build-interrupted", root / ".build-running"
    foreign = [root / "my-notes", root / ".venv-old", root / ("0" * 39 + "g")]  # not names the cache gives
    for d in (stale, fresh, *foreign):
        d.mkdir()
        (d / "model.onnx").write_bytes(b"x" * 100)
        os.utime(d, (old, old)) if d != fresh else None
    load(folder)  # a new entry prunes the others
    assert gone_entry not in entries() and stale.name not in entries()
    # a save that may still be running stays; so does an entry whose folder went missing only recently
    # (media unplugged), and whatever the cache did not name
    assert {fresh.name, away_entry, *(d.name for d in foreign)} < entries() and len(entries()) == 6


def test_a_cache_limit_that_is_not_a_size_is_said_and_the_default_used():
    with pytest.warns(RuntimeWarning, match="GPT2EDGE_GRAPH_CACHE_BYTES='lots' is not a size"):
        assert graph_cache.limit_bytes({"GPT2EDGE_GRAPH_CACHE_BYTES": "lots"}) == graph_cache.DEFAULT_LIMIT
    with pytest.warns(RuntimeWarning, match="is not a size"):  # a number past any float
        assert graph_cache.limit_bytes({"GPT2EDGE_GRAPH_CACHE_BYTES": "9" * 400}) == graph_cache.DEFAULT_LIMIT
    assert graph_cache.limit_bytes({"GPT2EDGE_GRAPH_CACHE_BYTES": "2G"}) == 2 << 30
    assert graph_cache.limit_bytes({}) == graph_cache.DEFAULT_LIMIT

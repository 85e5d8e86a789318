"""The server's slots (llama-server's /slots; gpt2edge.serve.scheduling.slot_files): a slot saved by one server
and restored into a fresh one continues with exactly the tokens the saving server gives (greedy and seeded, both
graph kinds), its cached tokens reused; hostile filenames, another folder's, a truncated, a tampered or a linked
file, an unknown slot or action, a missing flag are refused with a 4xx and one reason, the slots unchanged."""

from __future__ import annotations

import os

import httpx
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")

from click.testing import CliRunner  # noqa: E402

from gpt2edge.cli import main  # noqa: E402
from gpt2edge.errors import ServeError  # noqa: E402
from gpt2edge.runtime import Generator  # noqa: E402
from gpt2edge.runtime.model.prefix_cache import BLOCK, PrefixCache  # noqa: E402
from gpt2edge.serve import ServeConfig  # noqa: E402
from gpt2edge.serve.api.app import create_app  # noqa: E402
from gpt2edge.serve.hosting.server import BackgroundServer  # noqa: E402
from gpt2edge.serve.scheduling.continuous import ContinuousScheduler  # noqa: E402
from gpt2edge.serve.scheduling.slot_files import SlotFiles, SlotRefusal  # noqa: E402
from gpt2edge.serve.scheduling.slot_records import SlotBusy, SlotRecords  # noqa: E402

PROMPT = "You are a careful assistant. Answer briefly, in plain words, and never repeat the question back. The river"
GREEDY = {"max_tokens": 6, "temperature": 0, "logprobs": 1}
SEEDED = {"max_tokens": 6, "temperature": 1.0, "seed": 11, "logprobs": 1}


def _config(path, **kw) -> ServeConfig:
    return ServeConfig(model_name="tiny", max_batch=2, prefix_cache_bytes=1 << 24, slot_save_path=path, **kw)


def _complete(url: str, prompt: str, sampling: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, **sampling}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}  # fmt: skip


def _slot(url: str, slot, action: str, filename=None) -> httpx.Response:
    body = None if filename is None else {"filename": filename}
    return httpx.post(f"{url}/slots/{slot}", params={"action": action}, json=body, timeout=60)


@pytest.mark.parametrize("kind", ["concat", "shared"])
def test_a_restored_slot_continues_with_the_saving_server_s_tokens(kind, request, tmp_path):
    folder = request.getfixturevalue("tiny_export" if kind == "concat" else "tiny_export_shared")
    gen = Generator(folder)
    config = _config(str(tmp_path / "slots"))
    with BackgroundServer(create_app(lambda: ContinuousScheduler(gen, config), config)) as url:
        first = _complete(url, PROMPT, GREEDY)
        slots = httpx.get(url + "/slots", timeout=10).json()
        assert len(slots) == 2 and not slots[0]["is_processing"] and slots[1]["n_tokens"] == 0
        history = slots[0]["n_tokens"]  # the prompt and the generated tokens it fed
        saved = _slot(url, 0, "save", "chat.bin").json()
        assert saved["id_slot"] == 0 and saved["filename"] == "chat.bin" and saved["n_saved"] == history
        assert saved["n_cached"] == history // BLOCK * BLOCK > 0 and "save_ms" in saved["timings"]
        assert saved["n_written"] == (tmp_path / "slots" / "chat.bin").stat().st_size
        follow = PROMPT + first["text"] + " and then"
        want = [_complete(url, follow, s) for s in (GREEDY, SEEDED)]
    assert want[0]["cached"] > 0

    fresh = Generator(folder)  # a new server: an empty prefix cache
    with BackgroundServer(create_app(lambda: ContinuousScheduler(fresh, config), config)) as url:
        restored = _slot(url, 1, "restore", "chat.bin").json()
        assert (restored["n_restored"], restored["n_cached"]) == (history, saved["n_cached"])
        assert restored["n_read"] == saved["n_written"] and "restore_ms" in restored["timings"]
        assert httpx.get(url + "/slots", timeout=10).json()[1]["n_tokens"] == history
        got = [_complete(url, follow, s) for s in (GREEDY, SEEDED)]
    assert got == want  # the same text, log-probs and cached tokens


@pytest.fixture(scope="module")
def slot_server(tiny_export, tmp_path_factory):
    """A server with one saved slot file (chat.bin) and an outside folder beside its slot folder."""
    root = tmp_path_factory.mktemp("slots")
    config = _config(str(root / "slots"))
    gen = Generator(tiny_export)
    with BackgroundServer(create_app(lambda: ContinuousScheduler(gen, config), config)) as url:
        _complete(url, PROMPT, GREEDY)
        assert _slot(url, 0, "save", "chat.bin").status_code == 200
        yield url, root, gen


HOSTILE = ["../chat.bin", "a/b", "/etc/passwd", "", ".hidden", "..", "x" * 129, "a\x00b", "a b", "ü.bin", 5, None]


@pytest.mark.parametrize("name", HOSTILE, ids=[repr(n)[:12] for n in HOSTILE])
def test_hostile_filenames_are_refused_and_nothing_changes(slot_server, name):
    url, root, _ = slot_server
    before = httpx.get(url + "/slots", timeout=10).json(), sorted(os.listdir(root / "slots"))
    for action in ("save", "restore"):
        r = httpx.post(f"{url}/slots/0", params={"action": action}, json={"filename": name}, timeout=10)
        assert r.status_code == 400 and "Invalid filename" in r.json()["error"]["message"]
    assert (httpx.get(url + "/slots", timeout=10).json(), sorted(os.listdir(root / "slots"))) == before


def _write_damaged(root, name: str, edit) -> None:
    data = bytearray((root / "slots" / "chat.bin").read_bytes())
    (root / "slots" / name).write_bytes(bytes(edit(data)))


def test_bad_files_slots_and_actions_are_refused_with_a_reason(slot_server, tiny_export, tiny_export_shared):
    url, root, _ = slot_server
    slots = root / "slots"
    _write_damaged(root, "cut.bin", lambda d: d[: len(d) - 100])

    def flip(d):
        d[-7] ^= 1
        return d

    _write_damaged(root, "flip.bin", flip)
    other = Generator(tiny_export_shared).session()
    other.generate("The river", max_new_tokens=2, do_sample=False)
    other.save(slots / "other.bin")  # another export folder's session
    (root / "outside.bin").write_bytes((slots / "chat.bin").read_bytes())
    (slots / "link.bin").symlink_to(root / "outside.bin")
    (slots / "dir.bin").mkdir()
    before = httpx.get(url + "/slots", timeout=10).json()
    cases = [
        ((1, "restore", "cut.bin"), 400, "truncated"),
        ((1, "restore", "flip.bin"), 400, "damaged"),
        ((1, "restore", "other.bin"), 400, "another export folder"),
        ((1, "restore", "link.bin"), 400, "not a plain file"),
        ((1, "save", "link.bin"), 400, "not a plain file"),
        ((1, "restore", "dir.bin"), 400, "not a plain file"),
        ((1, "restore", "nothing.bin"), 404, "No slot file named 'nothing.bin'"),
        ((2, "restore", "chat.bin"), 400, "Slot 2 does not exist"),
        (("x", "restore", "chat.bin"), 400, "whole number"),
        ((0, "copy", "chat.bin"), 400, "Unknown slot action 'copy'"),
    ]
    for (slot, action, name), status, reason in cases:
        r = _slot(url, slot, action, name)
        message = r.json()["error"]["message"]
        assert r.status_code == status and reason in message, (slot, action, name, r.text)
        assert str(root) not in message  # the server's folders are not the client's business
    assert httpx.get(url + "/slots", timeout=10).json() == before
    assert (root / "outside.bin").read_bytes() == (slots / "chat.bin").read_bytes()  # nothing written through
    r = httpx.post(f"{url}/slots/0", params={"action": "restore"}, content=b"[1]", timeout=10)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    mine = Generator(tiny_export).session()  # Session.save's file is a slot file of the same folder
    mine.generate(PROMPT, max_new_tokens=3, do_sample=False)
    mine.save(slots / "session.bin")
    restored = _slot(url, 1, "restore", "session.bin").json()
    assert restored["n_restored"] == len(mine.token_ids) and restored["n_cached"] > 0
    erased = _slot(url, 0, "erase").json()
    assert erased == {"id_slot": 0, "n_erased": before[0]["n_tokens"]} and erased["n_erased"] > 0
    assert httpx.get(url + "/slots", timeout=10).json()[0]["n_tokens"] == 0


def test_a_restore_larger_than_the_prefix_cache_is_refused_before_reading(slot_server):
    url, root, gen = slot_server
    small = PrefixCache.for_graph(gen.graph, 1)  # room for no block at all
    files = SlotFiles(SlotRecords(2), small, gen.lm, str(root / "slots"))
    with pytest.raises(SlotRefusal, match="cached positions, more than the 0 that fit here") as e:
        files.action(0, "restore", "chat.bin")
    assert e.value.status == 400 and small.snapshot()["blocks"] == 0 and files.records.snapshot()[0] == (False, [])


def test_a_busy_slot_is_refused_and_ids_are_given_back():
    records = SlotRecords(3)
    assert records.take(2) == [0, 1] and records.take(2) == [2, -1]
    with pytest.raises(SlotBusy):
        records.tokens(1)
    records.give_back(1, [5, 6])
    assert records.take(1) == [1] and records.snapshot()[1] == (True, [5, 6])
    records.give_back(-1, [9])  # a row past the slots: nothing to record


def test_the_flags_are_refused_without_what_they_need(tiny_export, tmp_path):
    with pytest.raises(ServeError, match="--slot-save-path needs --scheduler continuous and --prefix-cache-bytes"):
        ServeConfig(model_name="tiny", slot_save_path=str(tmp_path))
    with pytest.raises(ServeError, match="--slot-save-path needs"):
        ServeConfig(model_name="tiny", scheduler="next-batch", prefix_cache_bytes=1 << 20, slot_save_path="x")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ServeError, match="--slot-save-path .*file"):
        ContinuousScheduler(Generator(tiny_export), _config(str(tmp_path / "file")))
    result = CliRunner().invoke(main, ["serve", str(tiny_export), "--slot-save-path", str(tmp_path)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and "--prefix-cache-bytes" in lines[0]


def test_without_the_path_or_the_cache_slots_say_which_flag(tiny_export):
    gen = Generator(tiny_export)
    for config, get_status in ((ServeConfig(model_name="tiny", max_batch=2, prefix_cache_bytes=1 << 20), 200),
                               (ServeConfig(model_name="tiny", max_batch=2), 501)):  # fmt: skip
        with BackgroundServer(create_app(lambda c=config: ContinuousScheduler(gen, c), config)) as url:
            r = httpx.get(url + "/slots", timeout=10)
            assert r.status_code == get_status
            r = _slot(url, 0, "save", "chat.bin")
            flag = "--slot-save-path" if get_status == 200 else "--prefix-cache-bytes"
            assert r.status_code == 501 and flag in r.json()["error"]["message"]


def test_saves_and_restores_beside_running_requests(tiny_export, tmp_path):
    """Slot actions run on HTTP threads while the scheduler thread adds to and evicts from the same cache: every
    request still answers, every action answers 200 or 409 (a running slot), and the files stay readable."""
    from concurrent.futures import ThreadPoolExecutor

    gen = Generator(tiny_export)
    config = ServeConfig(model_name="tiny", max_batch=4, prefix_cache_bytes=1 << 22, slot_save_path=str(tmp_path))
    with BackgroundServer(create_app(lambda: ContinuousScheduler(gen, config), config)) as url:
        _complete(url, PROMPT, GREEDY)
        assert _slot(url, 0, "save", "base.bin").status_code == 200

        def actions(k: int) -> list[int]:
            codes = []
            for i in range(6):
                codes.append(_slot(url, k % 4, "save", f"s{k}-{i}.bin").status_code)
                codes.append(_slot(url, (k + 1) % 4, "restore", "base.bin").status_code)
                codes.append(httpx.get(url + "/slots", timeout=10).status_code)
            return codes

        with ThreadPoolExecutor(8) as pool:
            texts = [pool.submit(_complete, url, f"{PROMPT} {i}", GREEDY) for i in range(8)]
            codes = [pool.submit(actions, k) for k in range(2)]
            answers = [t.result()["text"] for t in texts]
            codes = [c for f in codes for c in f.result()]
        assert all(answers) and set(codes) <= {200, 409} and 200 in codes
        for name in sorted(p.name for p in tmp_path.iterdir()):
            assert _slot(url, 3, "restore", name).status_code == 200, name  # every file written whole
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]  # no temp file left

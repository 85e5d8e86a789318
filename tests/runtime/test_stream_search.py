"""A folder whose generation_config.json asks for beam search (or several sequences) is never silently decoded as
one sequence. The Python API refuses where it yields one sequence (stream(), sessions), as transformers refuses a
streamer with beam search, unless the call says num_beams=1; the CLI follows the folder and says on stderr what
it does instead of streaming (or, with -i, that it decodes one sequence); --sequential is honoured."""

from __future__ import annotations

import json
import shutil

import pytest

from gpt2edge.errors import GenerationError
from gpt2edge.manifest import load_manifest, write_manifest
from gpt2edge.runtime import Generator
from tests.support import cli


def folder_with(tiny_export, tmp_path_factory, name: str, **config):
    """A copy of the tiny export whose generation_config.json adds `config` (checksums rewritten)."""
    out = tmp_path_factory.mktemp("gc") / name
    shutil.copytree(tiny_export, out)
    path = out / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    write_manifest(out, dict(load_manifest(out).raw))
    return out


@pytest.fixture(scope="module")
def beams(tiny_export, tmp_path_factory):
    return folder_with(tiny_export, tmp_path_factory, "beams", num_beams=4)


@pytest.fixture(scope="module")
def samples(tiny_export, tmp_path_factory):
    return folder_with(tiny_export, tmp_path_factory, "samples", num_return_sequences=2, do_sample=True)


# --- Python API --------------------------------------------------------------------------------------------------


def test_stream_refuses_the_folders_beam_search(beams):
    gen = Generator(beams)
    with pytest.raises(GenerationError, match=r"generation_config.json asks for num_beams=4; pass num_beams=1"):
        gen.stream("The river", max_new_tokens=4)
    streamed = "".join(gen.stream("The river", max_new_tokens=4, num_beams=1))
    assert streamed == gen.generate("The river", max_new_tokens=4, num_beams=1).text
    assert gen.generate("The river", max_new_tokens=4).sequence_score is not None  # generate() follows the folder


def test_stream_refuses_several_sequences_from_the_folder_or_the_call(samples, tiny_export):
    with pytest.raises(GenerationError, match=r"generation_config.json asks for num_return_sequences=2"):
        Generator(samples).stream("The river", max_new_tokens=4)
    with pytest.raises(GenerationError, match=r"the call asks for num_beams=3"):
        Generator(tiny_export).stream("The river", max_new_tokens=4, num_beams=3)
    assert "".join(Generator(samples).stream("x", max_new_tokens=2, num_return_sequences=1, seed=0))


@pytest.mark.parametrize("method", ["generate", "stream"])
def test_a_session_refuses_the_folders_beam_search(beams, method):
    gen = Generator(beams)
    session = gen.session()
    with pytest.raises(GenerationError, match=r"session.*num_beams=4"):
        getattr(session, method)("The river", max_new_tokens=3)
    assert session.token_ids == []  # refused before anything joined the context
    out = getattr(session, method)("The river", max_new_tokens=3, num_beams=1)
    text = out.text if method == "generate" else "".join(out)
    assert text and len(session.token_ids) > 3


# --- CLI ---------------------------------------------------------------------------------------------------------


def notes(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("note:")]


def test_cli_says_the_folders_beam_search_is_not_streamed(beams):
    out = cli("generate", beams, "-p", "The river", "-n", "4")
    assert out.exit_code == 0, out.output
    (note,) = notes(out)
    assert "num_beams=4" in note and "not streamed" in note and "--num-beams 1" in note, note
    best = Generator(beams).generate("The river", max_new_tokens=4)
    assert out.stdout == f"The river{best.text}\n"  # the beam search result, as generate() gives it


@pytest.mark.parametrize("extra", [["--no-stream"], ["--json"], ["--num-beams", "4"]])
def test_no_note_when_nothing_differs_from_the_request(beams, extra):
    out = cli("generate", beams, "-p", "The river", "-n", "4", *extra)
    assert out.exit_code == 0 and notes(out) == [], out.output


@pytest.mark.parametrize("extra", [[], ["--no-stream"], ["-p", "A"], ["-p", "A", "--sequential"]])
def test_cli_num_beams_1_decodes_one_sequence_over_the_folders_beams(beams, extra):
    """The flag wins over generation_config.json in every mode: streamed, whole, batched, one by one."""
    out = cli("generate", beams, "-p", "The river", "-n", "4", "--num-beams", "1", *extra)
    assert out.exit_code == 0 and notes(out) == [], out.output
    prompts = ["The river", *extra[1:2]]
    ref = Generator(beams).generate(prompts, max_new_tokens=4, num_beams=1)
    seps = [f"--- prompt {i + 1}/{len(prompts)} ---\n" if len(prompts) > 1 else "" for i in range(len(prompts))]
    assert out.stdout == "".join(f"{sep}{p}{r.text}\n" for sep, p, r in zip(seps, prompts, ref))


@pytest.mark.parametrize("sequential", [True, False])
def test_sequential_is_honoured_with_beam_search(beams, monkeypatch, sequential):
    calls = []
    original = Generator.request  # the CLI resolves each call once, then generates it

    def spy(self, prompt, **kwargs):
        calls.append(prompt if isinstance(prompt, str) else list(prompt))
        return original(self, prompt, **kwargs)

    monkeypatch.setattr(Generator, "request", spy)
    args = ["generate", beams, "-p", "The river", "-p", "A", "-n", "3", "--no-stream"]
    out = cli(*args, *(["--sequential"] if sequential else []))
    assert out.exit_code == 0, out.output
    assert calls == ([["The river"], ["A"]] if sequential else [["The river", "A"]])
    assert out.stdout.startswith("--- prompt 1/2 ---\nThe river") and "--- prompt 2/2 ---\nA" in out.stdout
    assert out.stderr.count("tokens/s]") == (2 if sequential else 1)  # timings per prompt when one at a time


def test_interactive_says_it_decodes_one_sequence(beams):
    out = cli("generate", beams, "-i", "-n", "3", input="The river\n")
    assert out.exit_code == 0, out.output
    (note,) = notes(out)
    assert "num_beams=4" in note and "-i" in note and "--num-beams 1" in note, note
    assert out.stdout.startswith(Generator(beams).generate("The river", max_new_tokens=3, num_beams=1).text)
    quiet = cli("generate", beams, "-i", "-n", "3", "--num-beams", "1", input="The river\n")
    assert quiet.exit_code == 0 and notes(quiet) == [], quiet.output
    refused = cli("generate", beams, "-i", "-n", "3", "--num-beams", "2", input="The river\n")
    assert refused.exit_code == 2 and "--num-beams" in refused.output


@pytest.mark.parametrize(
    "extra", [["--num-return-sequences", "1"], ["--length-penalty", "2"], ["--early-stopping", "true"]]
)
def test_cli_notes_the_folders_beams_when_the_flags_given_leave_them_on(beams, extra):
    """A search flag that does not itself ask for beams (a count of 1, a length penalty) leaves the folder's beam
    search on, which still stops the default streaming: the note says so, as without the flag."""
    out = cli("generate", beams, "-p", "The river", "-n", "4", *extra)
    assert out.exit_code == 0, out.output
    (note,) = notes(out)
    assert "num_beams=4" in note and "not streamed" in note and "--num-beams 1" in note, note


def test_cli_notes_the_folders_several_sequences_over_num_beams_1(samples):
    out = cli("generate", samples, "-p", "The river", "-n", "3", "--num-beams", "1")
    assert out.exit_code == 0, out.output
    (note,) = notes(out)
    assert "num_return_sequences=2" in note and "num_beams" not in note and "--num-return-sequences 1" in note, note
    assert out.stdout.count("The river") == 2  # the folder's two samples, printed once complete


def test_folder_defaults_false_ignores_generation_config(tiny_export, tmp_path_factory):
    """generate(folder_defaults=False): transformers' defaults and the call's values only (what the server uses,
    since some knobs such as min_p have no value that means off): the same result as on a folder without them."""
    asks = folder_with(
        tiny_export, tmp_path_factory, "asks", num_beams=4, num_return_sequences=2, min_p=0.5, top_k=3,
        no_repeat_ngram_size=2, do_sample=True,
    )  # fmt: skip
    kw = dict(max_new_tokens=10, ignore_eos=True, temperature=0.9, top_k=0, seed=4)
    want = Generator(tiny_export).generate("The river", folder_defaults=False, **kw)
    got = Generator(asks).generate("The river", folder_defaults=False, **kw)
    assert got.token_ids == want.token_ids
    assert isinstance(Generator(asks).generate("The river", max_new_tokens=3, do_sample=False), list)  # its beams

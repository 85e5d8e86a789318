"""generate options that a mode cannot honour are refused, not silently dropped."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main


@pytest.mark.parametrize(
    "extra",
    [["--num-beams", "2"], ["--num-return-sequences", "2", "--do-sample"], ["--length-penalty", "2"],
     ["--early-stopping", "true"]],
)  # fmt: skip
def test_interactive_refuses_beam_search_options(tiny_export, extra):
    out = CliRunner().invoke(main, ["generate", str(tiny_export), "-i", "-n", "3", *extra], input="hello\n")
    assert out.exit_code == 2, out.output
    assert "-i" in out.output and extra[0] in out.output
    assert "Traceback" not in out.output


@pytest.mark.parametrize("port", ["65536", "99999", "-1"])
def test_serve_refuses_a_port_outside_0_to_65535(tiny_export, port, monkeypatch):
    """Out of range, the OS took the port modulo 65536 and the server listened on another port than asked."""
    import gpt2edge.serve.hosting.server as server

    def started(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(server, "serve_forever", started)
    out = CliRunner().invoke(main, ["serve", str(tiny_export), "--port", port])
    assert out.exit_code == 2 and "--port" in out.output and "65535" in out.output, out.output
    assert "Traceback" not in out.output


@pytest.fixture(scope="module")
def beams_by_default(tiny_export, tmp_path_factory):
    """A folder whose generation_config.json asks for beam search and two sequences (as some hub models do)."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("attack-gc") / "beams"
    shutil.copytree(tiny_export, out)
    path = out / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_beams": 3, "num_return_sequences": 2}))
    return out


@pytest.mark.parametrize("mode", [[], ["--no-stream"], ["--json"], ["-p", "The river"]])
def test_cli_follows_beam_search_from_generation_config_like_the_python_api(beams_by_default, mode):
    import json

    from gpt2edge.runtime import Generator

    ref = Generator(beams_by_default, verify=False).generate(["Once"], max_new_tokens=4)[0]
    args = ["generate", str(beams_by_default), "--no-verify", "-p", "Once", "-n", "4", *mode]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert "Traceback" not in out.output
    if mode == ["--json"]:
        rows = json.loads(out.stdout)["results"]
        assert [r["token_ids"] for r in rows] == [r.token_ids for r in ref]
    else:
        assert all(f"Once{r.text}" in out.stdout for r in ref)  # both sequences, best first


def test_several_greedy_sequences_error_names_the_cli_flag_that_fixes_it(tiny_export):
    """--temperature alone does not turn sampling on in the CLI (a note says so): the fix named must be one that
    works, and following it must work."""
    args = ["generate", str(tiny_export), "-p", "hi", "-n", "2", "--num-return-sequences", "2"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 1 and "--do-sample" in out.output and "--temperature" not in out.output, out.output
    assert CliRunner().invoke(main, [*args, "--do-sample"]).exit_code == 0


@pytest.mark.parametrize("host", ["", "  "])
def test_serve_refuses_an_empty_host(tiny_export, host, monkeypatch):
    """An empty --host (e.g. an unset "$HOST") bound every interface: the server was exposed, not on loopback."""
    import gpt2edge.serve.hosting.server as server

    def started(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(server, "serve_forever", started)
    out = CliRunner().invoke(main, ["serve", str(tiny_export), "--host", host, "--port", "0"])
    assert out.exit_code == 2 and "--host" in out.output and "0.0.0.0" in out.output, out.output
    assert "Traceback" not in out.output

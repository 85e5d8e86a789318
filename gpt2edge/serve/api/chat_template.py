"""Chat templates: where a folder keeps its template, and rendering it in a bounded process of its own.

The template is rendered as transformers' apply_chat_template renders it: jinja2's ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson` filter and `raise_exception`, given
`messages`, `add_generation_prompt=True` and the tokenizer's special tokens. The template comes from, in order:
the server's --chat-template file, the folder's chat_template.jinja, its tokenizer_config.json "chat_template".

Templates are untrusted code over untrusted messages: they run in template_worker.py's process (memory
budget, deadline, output cut at a byte limit), one render at a time, and every failure is a 400 that says why.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from gpt2edge.serve.api.protocol import ApiError

NO_TEMPLATE = (
    "This model's folder has no chat template (chat_template.jinja or tokenizer_config.json's chat_template), so "
    "/v1/chat/completions cannot render messages; use /v1/completions with a prompt, or start the server with "
    "--chat-template FILE."
)
WORKER = Path(__file__).with_name("template_worker.py")
GRACE_S = 3.0  # past the deadline the worker answers itself; past this too, it is killed and respawned


class ChatTemplate:
    """A template source and the special tokens it may name."""

    def __init__(self, source: str, tokens: dict[str, str]) -> None:
        self.source, self.tokens = source, tokens

    @staticmethod
    def find(folder: Path | None, override: str | None) -> ChatTemplate:
        return _find(None if folder is None else str(folder), override)


@lru_cache(maxsize=8)
def _find(folder: str | None, override: str | None) -> ChatTemplate:
    tokens: dict[str, str] = {}
    config: dict[str, Any] = {}
    if folder is not None and (Path(folder) / "tokenizer_config.json").is_file():
        try:
            config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                tokens[key] = value
    tokens.setdefault("eos_token", "<|endoftext|>")
    tokens.setdefault("bos_token", tokens["eos_token"])
    if override is not None:
        return ChatTemplate(Path(override).read_text(), tokens)
    if folder is not None and (Path(folder) / "chat_template.jinja").is_file():
        return ChatTemplate((Path(folder) / "chat_template.jinja").read_text(), tokens)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers uses "default"
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise ApiError(400, NO_TEMPLATE, "messages", "no_chat_template")
    return ChatTemplate(source, tokens)


class TemplateSandbox:
    """One worker process, started at the first render and again after one that had to be killed.
    render() blocks (call it off the event loop); renders take turns."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def render(self, template: ChatTemplate, messages: list[dict], limit: int) -> str:
        """The rendered prompt, or ApiError(400) naming what the template did wrong or which bound it hit."""
        request = {"source": template.source, "messages": messages, "tokens": template.tokens, "limit": limit,
                   "timeout_s": self.timeout_s}  # fmt: skip
        with self._lock:
            reply = self._ask(json.dumps(request) + "\n")
        if "text" in reply:
            return reply["text"]
        code = "template_error" if reply["error"] == "template" else "template_limit"
        raise ApiError(400, f"The chat template failed on these messages: {reply['message']}.", "messages", code)

    def _ask(self, line: str) -> dict:
        proc = self._worker()
        try:
            proc.stdin.write(line)
            proc.stdin.flush()
            # the worker answers by its deadline; a reply that does not come means it is stuck or gone
            ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s + GRACE_S)
            answer = proc.stdout.readline() if ready else ""
            if answer:
                return json.loads(answer)
        except (OSError, ValueError):
            pass
        self.close()
        return {"error": "limit", "message": f"it exhausted its process's bounds (memory or {self.timeout_s:g} s)"}

    def _worker(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            # -I: none of the caller's environment or working folder on the worker's path; sys.path is passed
            # on so that the jinja2 the server imports is the one the worker imports
            self._proc = subprocess.Popen([sys.executable, "-I", str(WORKER), json.dumps(sys.path)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          encoding="utf-8")  # fmt: skip
        return self._proc

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if proc is not None:
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass

"""The chat-template sandbox's own process: it renders templates one at a time under hard bounds, so a template
that amplifies its input (nested loops, `'x' * 10**9`, `|center(10**8)`, doubling a string in a loop,
recursive macros) costs at most its memory budget and its time, never the server's.

A thread cannot be stopped and jinja's sandbox checks attribute access, not work, so the bounds are the
operating system's and the interpreter's: the address space is capped (RLIMIT_AS: an allocation past it is a
MemoryError), a watchdog thread interrupts a render that runs past its deadline (KeyboardInterrupt at the
next bytecode; it ends the process if even that does not come back), and the output is taken piece by piece
with generate() and cut at its byte limit.

Run as a script by serve/api/chat_template.py (`python -I template_worker.py SYS_PATH_JSON`: it imports only
the standard library and jinja2); one JSON request per stdin line, one JSON reply per stdout line.
"""

from __future__ import annotations

import _thread
import json
import sys
import threading
import time

MEMORY_BUDGET = 512 << 20  # bytes of address space a render may add to the idle process
HARD_EXIT_S = 2.0  # past its deadline plus this, a render that ignores the interrupt ends the process


class Watchdog:
    """Interrupts the main thread at the deadline of the render in progress."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self.fired = False
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, seconds: float) -> None:
        with self._cond:
            self._deadline, self.fired = time.monotonic() + seconds, False
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                if not self.fired:  # first the interrupt; the render then answers "took too long"
                    self.fired = True
                    _thread.interrupt_main()
                    self._deadline = time.monotonic() + HARD_EXIT_S
                else:  # stuck in one C call past the grace: the parent respawns the process
                    import os

                    os._exit(3)


def limit_memory(budget: int) -> None:
    try:
        import resource

        with open("/proc/self/statm") as f:  # the idle process's size: pages of address space
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + budget, resource.RLIM_INFINITY))
    except (ImportError, OSError, ValueError):  # no /proc or no RLIMIT_AS (macOS, Windows): the deadline still holds
        pass


def environment():
    """transformers' apply_chat_template environment (its _compile_jinja_template)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def render(env, cache: dict, req: dict, watchdog: Watchdog) -> dict:
    """{"text": ...}, or {"error": kind, "message": why} (kind: "template" or "limit")."""
    import jinja2

    limit, timeout_s = int(req["limit"]), float(req["timeout_s"])
    pieces: list[str] = []
    watchdog.arm(timeout_s)
    try:
        template = cache.get(req["source"])
        if template is None:
            if len(cache) >= 8:
                cache.clear()
            template = cache[req["source"]] = env.from_string(req["source"])
        size = 0
        for piece in template.generate(messages=req["messages"], add_generation_prompt=True, **req["tokens"]):
            size += len(piece.encode("utf-8", "surrogatepass"))
            if size > limit:
                return {"error": "too_large", "message": f"it renders more than {limit} bytes"}
            pieces.append(piece)
        return {"text": "".join(pieces)}
    except KeyboardInterrupt:
        return {"error": "too_slow", "message": f"it ran past its {timeout_s:g} s"}
    except MemoryError:
        return {"error": "too_large", "message": f"it needed more than {MEMORY_BUDGET >> 20} MiB"}
    except RecursionError:
        return {"error": "template", "message": "it recursed too deep (a macro calling itself?)"}
    except jinja2.exceptions.TemplateError as e:
        return {"error": "template", "message": str(e) or type(e).__name__}
    except Exception as e:  # the sandbox's range() OverflowError, {% include %} with no loader, a bad filter call
        return {"error": "template", "message": f"{type(e).__name__}: {e}"}
    finally:
        watchdog.disarm()  # first: an interrupt landing after this point has no deadline left to come from
        pieces.clear()


def main() -> None:
    if len(sys.argv) > 1:  # the server's import path, for a jinja2 found only through it
        sys.path[:] = [p for p in json.loads(sys.argv[1]) if p] + sys.path
    env, cache, watchdog = environment(), {}, Watchdog()
    limit_memory(MEMORY_BUDGET)
    for line in sys.stdin:
        try:
            reply = render(env, cache, json.loads(line), watchdog)
        except KeyboardInterrupt:  # the deadline struck just as the render ended
            watchdog.disarm()  # else its hard exit would still come, to an idle worker
            reply = {"error": "too_slow", "message": "it ran past its deadline"}
        except MemoryError:
            reply = {"error": "too_large", "message": f"it needed more than {MEMORY_BUDGET >> 20} MiB"}
        try:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
        except KeyboardInterrupt:  # a late interrupt cut the reply: the parent sees the process end, respawns it
            return


if __name__ == "__main__":
    main()

"""Temporary sibling folders: where a folder is built (.NAME.tmp-...), an old one is moved aside (.NAME.old-...)
and marked for deletion once replaced (.NAME.del-...).

Each name carries its owner (host, pid, process start time), so that the next write into the same parent deals
with the ones whose process is gone (SIGKILL, power loss) and never with one still being written: a .tmp- or
.del- folder is removed; an .old- folder holds the user's OUT, so it is put back when OUT is missing and
otherwise left alone, never deleted (gpt2edge.folder.swap).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
from pathlib import Path

# .NAME.tmp-HOST-PID-START-RANDOM: HOST tells folders of other machines (or containers) apart, START (the
# process start time) tells a reused pid apart
_TEMP_RE = re.compile(r"^\..*\.(tmp|old|del)-([0-9a-f]{8})-(\d+)-(\d+)-[0-9a-f]+$")


def host_tag() -> str:
    """This host's tag in a temp folder's name (a stale folder is cleaned only by the host that made it)."""
    import socket  # here: only a write needs it, and every start that opens a folder would pay its import

    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _start_token(pid: int) -> str:
    """The process start time (clock ticks since boot) from /proc, or "0" where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def make_temp(parent: Path, name: str, kind: str) -> Path:
    """A new folder .NAME.KIND-HOST-PID-START-RANDOM in `parent` (mkdir: never an existing one)."""
    pid = os.getpid()
    path = parent / f".{name[:100]}.{kind}-{host_tag()}-{pid}-{_start_token(pid)}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return path


def _owner_alive(host: str, pid: int, token: str) -> bool:
    """Whether the process that made a temp folder may still run; unknown (another host) counts as alive."""
    if host != host_tag():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # EPERM: it exists, under another user
    now = _start_token(pid)
    return token == "0" or now == "0" or now == token  # a different start time: the pid was reused


def _stale(parent: Path, kinds: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(kind, path) of the temp folders in `parent` of those kinds whose process is gone."""
    found = []
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in entries:
            m = _TEMP_RE.match(entry.name)
            if m and m[1] in kinds and entry.is_dir(follow_symlinks=False) and not _owner_alive(m[2], int(m[3]), m[4]):
                found.append((m[1], Path(entry.path)))
    return found


def restore_stale(parent: Path) -> list[Path]:
    """Put back each folder a killed writer had moved aside (.NAME.old-...) whose NAME is missing; returns where
    each went. One whose NAME exists again is left as it is: it is the user's, never deleted blindly."""
    from gpt2edge.folder.swap import restore_one

    return [dest for _, old in _stale(parent, ("old",)) if (dest := restore_one(old)) is not None]


def clean_stale(parent: Path) -> list[Path]:
    """Remove the .tmp- and .del- folders in `parent` whose process is gone (killed mid-write), after putting
    back what a killed swap left aside (`restore_stale`); returns what was removed."""
    restore_stale(parent)
    removed = []
    for _, path in _stale(parent, ("tmp", "del")):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed

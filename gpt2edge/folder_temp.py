"""Temporary sibling folders: where a folder is built (.NAME.tmp-...) or an old one is moved aside (.NAME.old-...).

Each name carries its owner (host, pid, process start time), so that the next write into the same parent removes
the ones whose process is gone (SIGKILL, power loss) and never one still being written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import socket
from pathlib import Path

# .NAME.tmp-HOST-PID-START-RANDOM: HOST tells folders of other machines (or containers) apart, START (the
# process start time) tells a reused pid apart
_TEMP_RE = re.compile(r"^\..*\.(?:tmp|old)-([0-9a-f]{8})-(\d+)-(\d+)-[0-9a-f]+$")


def _host_tag() -> str:
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
    path = parent / f".{name[:100]}.{kind}-{_host_tag()}-{pid}-{_start_token(pid)}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return path


def _owner_alive(host: str, pid: int, token: str) -> bool:
    """Whether the process that made a temp folder may still run; unknown (another host) counts as alive."""
    if host != _host_tag():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # EPERM: it exists, under another user
    now = _start_token(pid)
    return token == "0" or now == "0" or now == token  # a different start time: the pid was reused


def clean_stale(parent: Path) -> list[Path]:
    """Remove the temp folders in `parent` whose process is gone (killed mid-write); returns what was removed."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in entries:
            m = _TEMP_RE.match(entry.name)
            if m and entry.is_dir(follow_symlinks=False) and not _owner_alive(m[1], int(m[2]), m[3]):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
    return removed

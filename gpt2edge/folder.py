"""Atomic model folders: built in a temporary sibling, renamed into place only when complete."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gpt2edge.errors import OutputExistsError


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an existing output before any work starts, so a long export is never lost to this."""
    if out.exists() and not force:
        raise OutputExistsError(f"Output folder {out} already exists; pass --force to replace it.")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"Output path {out} exists and is not a folder; remove it or choose another path.")


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to `out`; on success it becomes `out`, on any failure it is removed.

    The temp folder sits in the same parent so the final rename never crosses a file system.
    KeyboardInterrupt is a BaseException and is caught too: Ctrl-C leaves nothing behind.
    """
    out = Path(out)
    check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # mkdtemp makes a private (0700) folder; the result should get the usual permissions
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        yield tmp
        if out.exists():
            # replace (only reached with force): move the old folder aside first so out is never half-written
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            old.rmdir()
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

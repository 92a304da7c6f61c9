"""Run a command with a small private tmpfs mounted on a directory: a disk that fills up, for tests
of what a full disk does (``tests/test_faults_durable.py``).

The mount lives in a mount namespace of the command's own (``unshare -m``; ``-r`` too when not root,
where the kernel allows unprivileged user namespaces), so nothing outside sees it and it goes away
with the command; every process the command starts (Ray's workers included) sees it. Its contents
are copied out to ``keep`` before it goes.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path


def _unshare(mountpoint: Path, size_bytes: int, command: str) -> list[str]:
    flags = "-m" if os.geteuid() == 0 else "-rm"
    mount = f"mount -t tmpfs -o size={size_bytes} tmpfs {shlex.quote(str(mountpoint))}"
    return ["unshare", flags, "sh", "-c", f"{mount} && {command}"]


@functools.cache
def tmpfs_unavailable() -> str | None:
    """``None`` if a private tmpfs can be mounted here, else why not (a reason to skip a test)."""
    if shutil.which("unshare") is None:
        return "no `unshare` command (util-linux) to make a private mount namespace"
    with tempfile.TemporaryDirectory() as directory:
        try:
            done = subprocess.run(_unshare(Path(directory), 1 << 20, "true"), capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`unshare` failed to run: {exc}"
    if done.returncode != 0:
        return (f"cannot mount a private tmpfs (`unshare -m[r] mount -t tmpfs` exited {done.returncode}: "
                f"{done.stderr.strip()[:200]}); it needs root or unprivileged user namespaces")
    return None


def run_in_tmpfs(argv: Sequence[str], mountpoint: Path, size_bytes: int, keep: Path | None = None,
                 env: Mapping[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``argv`` with a tmpfs of ``size_bytes`` mounted on ``mountpoint`` (an existing directory);
    afterwards its files are copied to ``keep`` (if given). Returns the finished process (its
    output captured as text)."""
    reason = tmpfs_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    command = shlex.join(list(argv)) + "; rc=$?"
    if keep is not None:
        command += f"; mkdir -p {shlex.quote(str(keep))} && cp -a {shlex.quote(str(mountpoint))}/. {shlex.quote(str(keep))}/"
    command += "; exit $rc"
    return subprocess.run(_unshare(mountpoint, size_bytes, command), capture_output=True, text=True,
                          timeout=timeout, env=dict(env) if env is not None else None)


def fill(directory: Path, leave_bytes: int) -> Path:
    """Take the free space of ``directory``'s file system but ``leave_bytes``, with one file
    (returned; delete it to give the space back)."""
    filler = Path(directory) / "filler"
    free = shutil.disk_usage(directory).free
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(free - leave_bytes, 1))
    return filler

"""Nothing outlives the run: a small watcher process for a local Ray cluster that we started.

Ray starts its head processes (GCS, raylet, dashboard) so that the kernel kills them with the
controller (``PR_SET_PDEATHSIG``), but the raylet's children do not share that fate: after a SIGKILL
of the controller the Ray workers take seconds to notice, and the dashboard agent and the runtime-env
agent spend a minute or more reporting the raylet's death to a GCS that is gone. So when
:func:`~rltrainer.controller.worker_group.ensure_ray` starts a cluster, it starts this watcher beside
it: a plain interpreter (the standard library only, a few MB) in a session of its own, which waits for
the controller to end and then stops every process of that Ray session (those holding a file of the
session directory open or naming it on their command line: Ray's stdout and stderr go to its logs,
so engine processes started by a worker are found too): SIGTERM, then SIGKILL after a grace period.
A clean :func:`shutdown_ray` stops the watcher first. (Reward pool workers watch the controller
themselves: :mod:`rltrainer.rewards.parallel`.)

Run as a script: ``python reaper.py <controller pid> <session dir>``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

GRACE_S = 2.0  # from SIGTERM to SIGKILL
QUIET_S = 1.0  # the session must show no process for this long before the watcher ends

_watcher: subprocess.Popen | None = None


def start_reaper(session_dir: str) -> None:
    """Start the watcher for this process and Ray's ``session_dir`` (Linux; elsewhere nothing)."""
    global _watcher
    if not sys.platform.startswith("linux") or _watcher is not None:
        return
    _watcher = subprocess.Popen(  # its own session: a Ctrl-C or a closed terminal does not reach it
        [sys.executable, "-S", "-u", os.path.abspath(__file__), str(os.getpid()), session_dir],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)


def shutdown_ray() -> None:
    """``ray.shutdown()``, after standing the watcher down (Ray stops its own processes)."""
    global _watcher
    import ray

    if _watcher is not None:
        _watcher.terminate()
        _watcher.wait()
        _watcher = None
    ray.shutdown()


# -- the watcher ----------------------------------------------------------------------------------
def wait_for_exit(pid: int) -> None:
    """Return when process ``pid`` (this watcher's parent at start) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # an older kernel: poll for the parent to change
        while os.getppid() == pid:
            time.sleep(0.2)
        return
    select.select([fd], [], [])
    os.close(fd)


def session_processes(session_dir: str) -> list[int]:
    """Processes of this user (other than this one) that hold a file under ``session_dir`` open or
    name it on their command line."""
    session_dir = session_dir.rstrip("/")
    prefix, me, found = session_dir + "/", os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            arguments = open(f"/proc/{entry}/cmdline", "rb").read()  # NUL after each argument
            if prefix.encode() in arguments or f"{session_dir}\0".encode() in arguments or any(
                    os.readlink(f"/proc/{entry}/fd/{fd}").startswith(prefix)
                    for fd in os.listdir(f"/proc/{entry}/fd")):
                found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def reap(session_dir: str) -> None:
    """Stop the session's processes: SIGTERM, SIGKILL for those left after ``GRACE_S``; again until
    none has been seen for ``QUIET_S``."""
    terminated: dict[int, float] = {}
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < QUIET_S:
        now = time.monotonic()
        for pid in session_processes(session_dir):
            quiet_since = now
            first = terminated.setdefault(pid, now)
            try:
                os.kill(pid, signal.SIGTERM if first == now else signal.SIGKILL if now - first > GRACE_S else 0)
            except OSError:
                pass
        time.sleep(0.1)


def main(argv: list[str]) -> None:
    controller, session_dir = int(argv[1]), argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wait_for_exit(controller)
    reap(session_dir)


if __name__ == "__main__":
    main(sys.argv)

"""Nothing outlives the run: after a SIGKILL of the controller (an FSDP2 fit on a Ray cluster it
started, 2 ranks, a reward pool), no process it started is alive 10 s later: not the Ray workers, the
raylet, the GCS, the dashboard agent, the runtime-env agent nor the reward workers.

The driver runs under a small harness that is a child subreaper (``PR_SET_CHILD_SUBREAPER``): every
process the driver started stays in the harness's process tree when its parent dies, so the test
finds them all by the tree, whatever their command line says (Ray's agents rename themselves)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rltrainer.controller.reaper import session_processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process trees read from /proc")

DRIVER = '''
import os, sys
from rltrainer import GRPO, Trainer, prompt_dataloader
from rltrainer.data import load_rows, prepare_gsm8k
from rltrainer.testing import data_path, load_tokenizer, tiny_qwen2_config

tok = load_tokenizer("gsm8k-bpe4k")
rows = prepare_gsm8k(load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(8)), tok, max_prompt_length=160)


def reward(completions, **kwargs):  # in a pool worker: the run is under way once it has scored
    open(sys.argv[1], "a").write(f"{os.getpid()}\\n")
    return [0.0] * len(completions)


module = GRPO(tiny_qwen2_config(len(tok), hidden_size=32, num_layers=2), tok, reward_funcs=reward,
              num_generations=2, max_new_tokens=4, reward_num_workers=2)
Trainer(strategy=sys.argv[2], devices=int(sys.argv[3]), max_steps=100_000, max_epochs=100_000, logger=False,
        enable_progress_bar=False).fit(module, prompt_dataloader(rows, batch_size=2))
'''

HARNESS = '''
import ctypes, os, subprocess, sys, time
PR_SET_CHILD_SUBREAPER = 36
assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
driver = subprocess.Popen(sys.argv[1:])
print(driver.pid, flush=True)
while True:  # reap whatever is handed to us, so that the dead do not show as zombies
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.1)
'''


def descendants(root: int) -> dict[int, str]:
    """Live (not zombie) processes under ``root``: pid -> name."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        children.setdefault(int(rest[1]), []).append(int(entry))  # a dying parent's children still count
        if rest[0] not in "ZX":
            names[int(entry)] = name
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child in names:
                found[child] = names[child]
            todo.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


@pytest.mark.slow
@pytest.mark.parametrize("strategy, devices, expected", [
    ("single", 1, ()),  # the reward workers alone
    ("fsdp2", 2, ("raylet", "gcs_server", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::FSDP2Worker")),
])
def test_nothing_outlives_a_controller_killed_with_sigkill(strategy, devices, expected, tmp_path):
    script, ready = tmp_path / "driver.py", tmp_path / "scored.txt"
    script.write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, sys.executable, str(script), str(ready),
                                strategy, str(devices)], env=env,
                               stdout=subprocess.PIPE, stderr=open(tmp_path / "driver.err", "w"), text=True)
    try:
        driver = int(harness.stdout.readline())
        deadline = time.monotonic() + 400
        while not ready.exists() and time.monotonic() < deadline and harness.poll() is None:
            time.sleep(0.5)
        assert ready.exists(), (tmp_path / "driver.err").read_text()[-3000:]
        time.sleep(1.0)
        before = descendants(harness.pid)
        names = " ".join(command_line(pid) for pid in before)  # Ray's agents and workers rename themselves there
        for part in expected:
            assert part in names, f"{part} not among the run's processes: {names}"
        reward_workers = {int(line) for line in ready.read_text().split()}
        assert reward_workers <= set(before), "the reward workers are not in the driver's process tree"

        os.kill(driver, signal.SIGKILL)
        killed = time.monotonic()
        left = descendants(harness.pid)
        while left and time.monotonic() - killed < 10.0:
            time.sleep(0.2)
            left = descendants(harness.pid)
        seconds = time.monotonic() - killed
        assert not left, "alive 10 s after the controller's SIGKILL: " + "; ".join(
            f"{pid} {name} [{command_line(pid)}]" for pid, name in sorted(left.items()))
        print(f"{strategy}: {len(before)} processes, none left {seconds:.1f} s after the SIGKILL")
    finally:
        for pid in descendants(harness.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        harness.kill()
        harness.wait()


def test_session_processes_are_found_by_their_open_files_and_command_line(tmp_path):
    session = tmp_path / "session_x"
    (session / "logs").mkdir(parents=True)
    with open(session / "logs" / "out.txt", "w") as log:  # its stdout, as Ray's processes have
        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=log)
    named = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(60)", f"--log-dir={session}/logs"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"{session}2"])
    try:
        for child, marker in ((holder, b"sleep(60)"), (named, b"--log-dir="), (other, b"session_x2")):  # exec'd
            deadline = time.monotonic() + 30
            while marker not in Path(f"/proc/{child.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
                time.sleep(0.05)
        found = set(session_processes(str(session)))
        assert {holder.pid, named.pid} <= found and other.pid not in found and os.getpid() not in found
    finally:
        for process in (holder, named, other):
            process.kill()
            process.wait()

"""A ``one_step_off`` / ``async`` run SIGKILLed between steps or at a step boundary, with rows in
flight, and resumed from its last checkpoint trains on the same prompts as an uninterrupted run
(none skipped, none repeated, across an epoch boundary) and ends with bit-equal weights (a seeded
engine; one replica, and two at ``max_staleness=2``: the versions are the schedule's). The runs
are subprocesses (``pipeline_resume_run.py``) on the session's Ray cluster; each records the
prompts of every step it trained, flushed before the step's checkpoint.

The unit tests at the end check what ``AsyncPipeline`` keeps, groups in ``ready`` included (one
replica never leaves finished groups over at a step boundary; two timing-driven ones would, but
which ones depends on timing)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rltrainer.checkpoints import safe_load
from rltrainer.controller.watchdog import Watchdog
from rltrainer.data.batch import RolloutBatch
from rltrainer.pipelines import AsyncPipeline, AsyncRun

SCRIPT = Path(__file__).with_name("pipeline_resume_run.py")
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6  # 12 prompts, 4 a step, 2 epochs
KILL_STEP = 3  # the last step of epoch 0: the next epoch's first batch is in flight (or held)


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory, gsm8k_prompts):
    """``run(pipeline, *args)`` -> its output directory (a fresh one unless ``out`` is given)."""
    address = ray_session.get_runtime_context().gcs_address
    rows = tmp_path_factory.mktemp("prompts") / "prompts.json"
    rows.write_text(json.dumps([{k: row[k] for k in ("prompt_ids", "answer")} for row in gsm8k_prompts]))
    env = {**os.environ, "RAY_ADDRESS": address, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def start(pipeline: str, *args: str, out: Path | None = None, killed: bool = False) -> Path:
        out = out or tmp_path_factory.mktemp(pipeline)
        done = subprocess.run([sys.executable, str(SCRIPT), str(out), pipeline, "--prompts", str(rows), *args], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == (-signal.SIGKILL if killed else 0), done.stderr[-4000:]
        return out

    return start


_uninterrupted: dict[tuple[str, ...], Path] = {}


def uninterrupted(run, pipeline: str, *args: str) -> Path:
    if (pipeline, *args) not in _uninterrupted:
        _uninterrupted[(pipeline, *args)] = run(pipeline, *args)
    return _uninterrupted[(pipeline, *args)]


def trained(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trained.jsonl").read_text().splitlines()]


def prompts(records: list[dict]) -> Counter:
    return Counter(tuple(p) for r in records for p in r["prompts"])


@pytest.mark.parametrize("pipeline,kill,args", [
    ("async", "boundary", ()), ("async", "mid_step", ()), ("one_step_off", "boundary", ()),
    ("async", "boundary", ("--max-staleness", "2", "--replicas", "2")),  # scheduled versions on two replicas
], ids=["async-boundary", "async-mid_step", "one_step_off-boundary", "async2-2replicas-boundary"])
def test_a_killed_run_resumes_without_losing_or_repeating_a_prompt(pipeline, kill, args, run):
    reference = uninterrupted(run, pipeline, *args)
    out = run(pipeline, *args, "--kill", kill, "--kill-step", str(KILL_STEP), killed=True)
    assert [r["step"] for r in trained(out)] == list(range(1, KILL_STEP + 1))  # SIGKILLed after its checkpoint
    if kill == "boundary":  # rows were held when it died
        held = json.loads((out / "killed.json").read_text())
        assert held["held_batch"] if pipeline == "one_step_off" else held["in_flight"] > 0, held
    run(pipeline, *args, "--resume", out=out)

    ours, theirs = trained(out), trained(reference)
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))  # each step once: nothing trained twice
    assert len(prompts(theirs)) == 12 and set(prompts(theirs).values()) == {2}  # each prompt once an epoch
    assert prompts(ours) == prompts(theirs)
    assert Counter(tuple(p) for r in ours for p in r["positions"]) == Counter(
        tuple(p) for r in theirs for p in r["positions"])
    for a, b in zip(ours, theirs):  # the same rows, made by the same versions
        assert (a["versions"], a["responses"]) == (b["versions"], b["responses"]), a["step"]
    weights, expected = torch.load(out / "weights.pt"), torch.load(reference / "weights.pt")
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_a_killed_run_on_two_replicas_that_drop_stale_groups_trains_every_prompt_once_an_epoch(run):
    """Two replicas, ``"drop"``: which groups finish first, and which version a queued request gets,
    is timing, so the rows (and weights) may differ from another run; the prompts trained may not."""
    reference = uninterrupted(run, "async")
    args = ("--replicas", "2", "--policy", "drop")
    out = run("async", *args, "--kill", "boundary", "--kill-step", str(KILL_STEP), killed=True)
    run("async", *args, "--resume", out=out)
    assert [r["step"] for r in trained(out)] == list(range(1, STEPS + 1))
    assert prompts(trained(out)) == prompts(trained(reference))


# -- what AsyncPipeline's checkpoint holds (no engine) ---------------------------------------------
def rows(position: tuple[int, int, int], version: int, group_size: int = 2) -> RolloutBatch:
    return RolloutBatch({"responses": torch.full((group_size, 3), position[2]),
                         "policy_version": torch.full((group_size,), version),
                         "prompt_position": torch.tensor([position] * group_size)},
                        non_tensors={"answer": [str(position)] * group_size}, logged={"timing_s/gen": 0.5})


def prompt(position: tuple[int, int, int]) -> RolloutBatch:
    return RolloutBatch({"prompt_position": torch.tensor([position])}, non_tensors={"prompt_ids": [[1, position[2]]]})


def pipeline_over(batches: list[tuple[int, int, RolloutBatch]]) -> AsyncRun:
    fit = SimpleNamespace(module=SimpleNamespace(sampling=SimpleNamespace(n=2)), step=3,
                          engine=SimpleNamespace(placement="split"),
                          watchdog=Watchdog())
    return AsyncPipeline(max_staleness=1, staleness_policy="wait").start(fit, batches)


def loader_batch(epoch: int, index: int) -> tuple[int, int, RolloutBatch]:
    return epoch, index, RolloutBatch.from_rows([{"prompt_ids": [1, row]} for row in range(2)])


def test_async_state_keeps_ready_in_flight_and_queued_groups(tmp_path):
    """``ready`` groups and in-flight rows come back with their versions and in their order, queued
    prompts stay queued, and none of them is read from the loader again."""
    from concurrent.futures import Future

    from rltrainer.pipelines import Prompts

    first = pipeline_over([])
    first.batch_size, first.consumed = 2, {(0, 0, 0), (0, 0, 1)}
    first.ready = [((0, 1, 1), rows((0, 1, 1), 2))]
    request: Future = Future()
    request.set_result(RolloutBatch.concat([rows((0, 2, 0), 3), rows((0, 2, 1), 3)]))
    request.prompts, request.replica = Prompts(RolloutBatch.concat([prompt((0, 2, 0)), prompt((0, 2, 1))]),
                                               [(0, 2, 0), (0, 2, 1)]), 0
    first._in_flight = [request]
    first.queue.append(((0, 1, 0), prompt((0, 1, 0))))  # e.g. a dropped group, queued again
    torch.save({"pipeline": first.state_dict()}, tmp_path / "state.pt")
    state = safe_load(tmp_path / "state.pt", "a test's pipeline state")["pipeline"]  # as a resume reads it

    resumed = pipeline_over([loader_batch(0, 0), loader_batch(0, 1), loader_batch(0, 2), loader_batch(1, 0)])
    resumed.load_state_dict(state)
    assert resumed.consumed == first.consumed and resumed.batch_size == 2
    assert [p for p, _ in resumed.ready] == [(0, 1, 1)]
    assert torch.equal(resumed.ready[0][1]["policy_version"], torch.tensor([2, 2]))
    assert list(resumed.ready[0][1]["answer"]) == ["(0, 1, 1)"] * 2
    (future,) = resumed._in_flight
    assert future.prompts.positions == [(0, 2, 0), (0, 2, 1)] and future.replica == 0
    assert torch.equal(future.result()["responses"], request.result()["responses"])
    assert [p for p, _ in resumed.queue] == [(0, 1, 0)]
    resumed.queue.clear()
    resumed._refill_queue()  # the loader's rows that the checkpoint holds (or trained) are skipped
    assert [p for p, _ in resumed.queue] == [(1, 0, 0), (1, 0, 1)]


def test_async_state_from_before_the_buffers_were_kept_still_loads():
    resumed = pipeline_over([loader_batch(0, 0), loader_batch(0, 1)])
    resumed.load_state_dict({"consumed": [[0, 0, 0], [0, 0, 1]]})
    resumed._refill_queue()
    assert [p for p, _ in resumed.queue] == [(0, 1, 0), (0, 1, 1)] and not resumed.ready and not resumed._in_flight

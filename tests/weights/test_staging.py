"""A rollout process's two threads, without Ray: receives stage their buckets while a request
holds the engine; the sync is applied in one session (start, every bucket in order, finish)
between two requests; a request that asks for a version waits for it; a load that fails stops the
engine; an engine that receives on its own is held from a sync's first bucket to its last."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rltrainer.weights.receiver import WeightReceiver
from rltrainer.weights.staging import EngineGate
from rltrainer.weights.wire import Bucket


class Engine:
    """Records every call with the thread it ran in; ``generate`` blocks until ``release`` is set."""

    native_weight_broadcast = False

    def __init__(self) -> None:
        self.weight_version = -1
        self.calls: list[tuple] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.generating = threading.Event()
        self.release = threading.Event()
        self.fail_on: str | None = None

    def generate(self) -> int:
        self.calls.append(("generate", self.weight_version))
        self.generating.set()
        assert self.release.wait(10), "the test never released generate"
        self.generating.clear()
        return self.weight_version

    def start_weight_update(self) -> None:
        self.calls.append(("start",))

    def update_weights(self, weights) -> dict[str, float]:
        for name, tensor in weights:
            if name == self.fail_on:
                raise RuntimeError(f"cannot load {name}")
            self.calls.append(("update", name))
            self.weights[name] = tensor.clone()
        return {}

    def finish_weight_update(self) -> None:
        self.calls.append(("finish",))


def bucket(*names: str, value: float = 1.0) -> Bucket:
    return Bucket.pack([(name, torch.full((2,), value)) for name in names])


def in_thread(fn, *args):
    """Run ``fn`` in a thread; returns the thread and a dict that receives its result or error."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def generate(gate: EngineGate, engine: Engine, min_version: int = -1) -> int:
    with gate.use(engine, min_version):
        return engine.generate()


def test_receives_stage_beside_a_request_and_the_sync_lands_after_it():
    gate, engine = EngineGate(), Engine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    running, result = in_thread(generate, gate, engine)
    assert engine.generating.wait(5)
    buckets = [bucket("a", "b"), bucket("c"), bucket("d")]
    for index, value in enumerate(buckets[:-1]):  # staged at once: the engine is generating
        assert receiver.load(engine, value, 7, index, 3) == {"tensors": len(value.entries), "bytes": value.nbytes}
    last, last_result = in_thread(receiver.load, engine, buckets[-1], 7, 2, 3)
    time.sleep(0.2)
    assert last.is_alive() and engine.calls == [("generate", -1)]  # the last waits for the request
    engine.release.set()
    running.join(5)
    last.join(5)
    assert result["result"] == -1 and "error" not in last_result
    assert engine.calls == [("generate", -1), ("start",), ("update", "a"), ("update", "b"), ("update", "c"),
                            ("update", "d"), ("finish",)]
    assert engine.weight_version == 7 and torch.equal(engine.weights["d"], torch.ones(2))


def test_a_request_waits_for_the_version_it_asks_for_and_applies_it_first():
    gate, engine = EngineGate(), Engine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    engine.release.set()
    waiting, result = in_thread(generate, gate, engine, 3)
    time.sleep(0.2)
    assert waiting.is_alive() and engine.calls == []  # version 3 has not arrived
    receiver.load(engine, bucket("a"), 3, 0, 2)
    time.sleep(0.1)
    assert waiting.is_alive()
    receiver.load(engine, bucket("b"), 3, 1, 2)  # the last: applied by whoever gets the engine first
    waiting.join(5)
    assert result["result"] == 3
    assert engine.calls == [("start",), ("update", "a"), ("update", "b"), ("finish",), ("generate", 3)]
    assert generate(gate, engine, 2) == 3  # an older version asked for: it has a later one


def test_a_sync_with_nothing_to_send_moves_the_version_between_requests():
    gate, engine = EngineGate(), Engine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    running, _ = in_thread(generate, gate, engine)
    assert engine.generating.wait(5)
    commit, _ = in_thread(receiver.commit, engine, 4)
    time.sleep(0.2)
    assert commit.is_alive() and engine.weight_version == -1  # not inside the request
    engine.release.set()
    commit.join(5)
    running.join(5)
    assert engine.weight_version == 4 and not [c for c in engine.calls if c[0] != "generate"]


def test_buckets_must_arrive_in_order_and_a_new_sync_drops_an_unfinished_one():
    gate, engine = EngineGate(), Engine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    with pytest.raises(RuntimeError, match="Bucket 1 of weight sync 2 arrived with none staged"):
        receiver.load(engine, bucket("a"), 2, 1, 2)
    receiver.load(engine, bucket("a"), 2, 0, 3)  # a sync that fails midway...
    receiver.load(engine, bucket("x", value=5.0), 3, 0, 1)  # ...is dropped by the next one
    assert engine.weight_version == 3 and list(engine.weights) == ["x"]
    assert engine.calls == [("start",), ("update", "x"), ("finish",)]


def test_a_second_sync_of_the_same_version_is_applied_too():
    gate, engine = EngineGate(), Engine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    receiver.load(engine, bucket("a", value=1.0), 0, 0, 1)
    receiver.load(engine, bucket("a", value=2.0), 0, 0, 1)  # e.g. two pushes of one version
    assert torch.equal(engine.weights["a"], torch.full((2,), 2.0)) and engine.weight_version == 0


def test_a_load_outside_a_sync_runs_now_in_a_session_and_keeps_the_version():
    gate, engine = EngineGate(), Engine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    assert receiver.load(engine, bucket("a", "b"))["tensors"] == 2
    assert engine.calls == [("start",), ("update", "a"), ("update", "b"), ("finish",)]
    assert engine.weight_version == -1


def test_a_failed_load_raises_in_the_receive_and_stops_later_requests():
    gate, engine = EngineGate(), Engine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    engine.fail_on = "b"
    with pytest.raises(RuntimeError, match="cannot load b"):  # the receive applied it: the engine's error
        receiver.load(engine, bucket("a", "b"), 5, 0, 1)
    engine.release.set()
    with pytest.raises(RuntimeError, match="Loading weight sync 5 into this engine failed"):
        generate(gate, engine)


class NativeEngine(Engine):
    """An engine that receives broadcast buckets itself (SGLang's schedulers)."""

    native_weight_broadcast = True

    def receive_weights(self, entries, last):
        self.calls.append(("receive", [e[0] for e in entries], last))
        return {"tensors": len(entries), "bytes": 8}


def test_a_native_sync_holds_the_engine_from_its_first_bucket_to_its_last():
    gate, engine = EngineGate(), NativeEngine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    entries = [("a", "float32", (2,))]
    receiver.receive(engine, entries, 2, 0, 2)
    engine.release.set()
    waiting, result = in_thread(generate, gate, engine)
    time.sleep(0.2)
    assert waiting.is_alive()  # the engine is mid-sync: no request runs between its buckets
    receiver.receive(engine, entries, 2, 1, 2)
    waiting.join(5)
    assert result["result"] == 2
    assert engine.calls == [("start",), ("receive", ["a"], False), ("receive", ["a"], True), ("finish",),
                            ("generate", 2)]


# -- holds: a rollout assigned a version keeps newer syncs out until it is over ---------------------
def test_a_held_version_keeps_a_newer_sync_out_of_its_requests_until_released():
    gate, engine = EngineGate(), Engine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    engine.release.set()
    receiver.load(engine, bucket("a", value=1.0), 1, 0, 1)
    gate.hold(1)  # a rollout of version 1 is coming (the engine is idle meanwhile)
    commit, committed = in_thread(receiver.load, engine, bucket("a", value=2.0), 2, 0, 1)
    time.sleep(0.2)
    assert commit.is_alive() and engine.weight_version == 1  # staged, not applied
    assert generate(gate, engine, 1) == 1 and generate(gate, engine, 1) == 1  # the held rollout's requests
    newer, newer_result = in_thread(generate, gate, engine, 2)
    time.sleep(0.2)
    assert newer.is_alive()  # version 2 is staged but held out
    gate.release_hold(1)
    commit.join(5)
    newer.join(5)
    assert "error" not in committed and newer_result["result"] == 2 and engine.weight_version == 2
    assert torch.equal(engine.weights["a"], torch.full((2,), 2.0))


def test_holds_count_per_rollout_and_a_release_may_arrive_before_its_hold():
    gate, engine = EngineGate(), Engine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    gate.release_hold(0)  # the rollout ended before its hold arrived (two threads of the process)
    gate.hold(0)
    gate.hold(1)
    gate.hold(1)  # two rollouts of version 1
    commit, _ = in_thread(receiver.commit, engine, 2)
    gate.release_hold(1)
    time.sleep(0.2)
    assert commit.is_alive() and engine.weight_version == -1  # one rollout of version 1 still holds it
    gate.release_hold(1)
    commit.join(5)
    assert engine.weight_version == 2


def test_a_native_sync_waits_for_the_rollouts_that_hold_an_older_version():
    gate, engine = EngineGate(), NativeEngine()
    receiver = WeightReceiver(torch.device("cpu"), gate)
    gate.hold(1)
    entries = [("a", "float32", (2,))]
    first, first_result = in_thread(receiver.receive, engine, entries, 2, 0, 1)
    time.sleep(0.2)
    assert first.is_alive() and engine.calls == []  # it would load in place: it waits for the hold
    gate.release_hold(1)
    first.join(5)
    assert "error" not in first_result and engine.weight_version == 2

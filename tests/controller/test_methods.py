"""Typed remote methods (``rltrainer.controller.methods``): a worker's ``@remote`` methods called
through ``group.remote``, their arguments checked before anything is sent."""

from __future__ import annotations

from typing import ClassVar

import pytest

from rltrainer.controller.methods import RANK_ZERO, RemoteCall, method_threads, remote, remote_methods
from rltrainer.rollout.worker import WEIGHTS_GROUP, InOrderWorker, Worker
from rltrainer.controller.worker_group import InProcessWorkerGroup, WorkerGroup
from rltrainer.strategies.rank_worker import TrainingWorker


class Echo:
    concurrency_groups: ClassVar[dict[str, int]] = {"side": 1}

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.calls = rank, []

    @remote(stage="echoes")
    def echo(self, value: int, scale: int = 1) -> int:
        self.calls.append(("echo", value, scale))
        return value * scale

    @remote(RANK_ZERO, thread="side")
    def first(self) -> str:
        return f"rank {self.rank}"

    def plain(self) -> None:
        """Not remote."""


class Recording(WorkerGroup):
    """Two ranks in this process; records what would be sent."""

    world_size = 2
    worker_cls = Echo

    def __init__(self) -> None:
        self.workers, self.sent = [Echo(r, 2) for r in range(2)], []

    def _call_async(self, ranks, method, per_rank):
        self.sent.append((method, ranks, list(per_rank)))
        return [getattr(self.workers[r], method)(*a, **kw) for r, (a, kw) in zip(ranks, per_rank)]

    def get(self, futures, method):
        self.sent.append(("get", method))
        return list(futures)


def test_a_remote_method_runs_on_every_rank_or_on_rank_zero():
    group = Recording()
    assert group.remote.echo(3, scale=2) == [6, 6]
    assert group.sent[-1] == ("get", "echoes")  # waited on as its stage
    assert group.remote.first() == "rank 0"
    assert group.sent[-2][:2] == ("first", [0])
    assert group.remote.echo.on_rank_zero(5) == 5  # a method of every rank, asked of rank 0
    assert group.sent[-2][:2] == ("echo", [0]) and group.workers[1].calls == [("echo", 3, 2)]


def test_start_returns_a_call_in_flight_and_each_gives_every_rank_its_own_arguments():
    group = Recording()
    call = group.remote.echo.each([(1,), (2,)])
    assert isinstance(call, RemoteCall) and call.as_call == (group, [1, 2], "echoes")
    assert call.get() == [1, 2] and call.ref() == 1
    with pytest.raises(ValueError, match=r"one argument tuple per rank \(2\), got 1"):
        group.remote.echo.each([(1,)])
    with pytest.raises(TypeError, match="runs on rank 0 only"):
        group.remote.first.each([(), ()])


def test_arguments_are_checked_against_the_signature_before_anything_is_sent():
    group = Recording()
    with pytest.raises(TypeError, match=r"echo\(value, scale=1\): got an unexpected keyword argument 'factor'"):
        group.remote.echo(1, factor=2)
    with pytest.raises(TypeError, match="missing a required argument: 'value'"):
        group.remote.echo.start()
    with pytest.raises(TypeError, match="too many positional arguments"):
        group.remote.echo.each([(1, 2, 3), (1,)])
    assert group.sent == []


def test_only_marked_methods_are_remote():
    with pytest.raises(AttributeError, match=r"Echo.plain is not a remote method .* echo, first"):
        Recording().remote.plain()
    assert set(remote_methods(Echo)) == {"echo", "first"}
    with pytest.raises(ValueError, match="dispatch must be one of 'all', 'rank_zero', got 'some'"):
        remote("some")


def test_an_in_process_group_calls_the_method_itself():
    group = InProcessWorkerGroup(Echo)
    assert group.remote.echo(4) == [4] and group.worker.calls == [("echo", 4, 1)]
    assert group.remote.first() == "rank 0"


def test_threads_come_from_the_marks_where_the_worker_class_has_that_group():
    assert method_threads(Echo) == {"first": "side"}
    receiving = method_threads(Worker)
    assert set(receiving) == {"load_bucket", "commit_weights", "take_weights_discarded", "weight_group_ranks",
                              "join_weight_group", "receive_bucket", "open_weight_slots", "load_slot",
                              "repair_weights", "configure_delta_receiver", "hold_weights"}
    assert set(receiving.values()) == {WEIGHTS_GROUP}
    assert method_threads(InOrderWorker) == {} and method_threads(TrainingWorker) == {}  # one thread, in order


def test_the_weight_protocol_waits_as_send_weights_and_receive_weights():
    """The watchdog's stages (and ``stage_timeout_s`` by name) stay ``send_weights`` / ``receive_weights``."""
    sending = {n: s for n, s in remote_methods(TrainingWorker).items() if s.stage == "send_weights"}
    assert set(sending) == {
        "plan_weights", "weight_entries", "export_bucket", "finish_weights", "load_local_weights", "host_weight_group",
        "broadcast_bucket", "leave_weight_group", "weight_slot_bytes", "create_weight_slots", "share_weight_slots",
        "unlink_weight_slots", "write_slot", "close_weight_slots", "configure_weight_sync", "encode_bucket",
        "base_buckets"}
    assert {n for n, s in sending.items() if s.dispatch == RANK_ZERO} == {
        "weight_entries", "host_weight_group", "leave_weight_group", "weight_slot_bytes", "create_weight_slots",
        "unlink_weight_slots", "base_buckets"}
    receiving = {n for n, s in remote_methods(Worker).items() if s.stage == "receive_weights"}
    assert receiving == set(method_threads(Worker))  # all of them in the weights thread, and only they


def test_an_override_of_a_remote_method_stays_remote_with_its_own_signature():
    class Louder(Echo):
        def echo(self, value: int, scale: int = 1, suffix: str = "!") -> int:  # not marked again
            return value * scale * 10

    class Group(Recording):
        worker_cls = Louder

    group = Group()
    group.workers = [Louder(r, 2) for r in range(2)]
    assert remote_methods(Louder)["echo"].stage == "echoes"
    assert group.remote.echo(1, suffix="?") == [10, 10]  # checked against the override's signature

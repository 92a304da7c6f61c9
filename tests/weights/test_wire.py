"""The weight-sync layer in one process: the wire format (every dtype, odd sizes, alignment), the
one bucketer, shared-memory slots, transport selection, and a sync handle's contract."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from rltrainer.weights.shm import SharedSlots
from rltrainer.weights.transports import SyncHandle, resolve_transport
from rltrainer.weights.wire import (Bucket, bucket_by_bytes, bucket_entries, bucket_nbytes, bucket_views, bucketed,
                                    empty_bucket, entry_offsets, flatten_bucket, flatten_into, plan_buckets)


def odd_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"bf16": torch.randn(3, 5).to(torch.bfloat16), "fp32": torch.randn(7), "i64": torch.arange(-3, 2),
            "scalar": torch.tensor(2.5), "fp16": torch.randn(1, 3).to(torch.float16), "flag": torch.tensor([True, False]),
            "empty": torch.zeros(0, 4), "byte": torch.arange(3, dtype=torch.uint8),
            "strided": torch.randn(4, 6)[:, ::2]}  # not contiguous


def test_wire_round_trip_keeps_every_dtype_and_aligns_every_view():
    tensors = odd_tensors()
    entries = bucket_entries((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
    sizes = [torch.empty((), dtype=getattr(torch, e[1])).element_size() for e in entries]
    assert sizes == sorted(sizes, reverse=True)  # larger elements first (a stable sort)
    assert [e[0] for e in entries][:2] == ["i64", "fp32"] and ("scalar", "float32", ()) in entries
    for (_, dtype, _), offset in zip(entries, entry_offsets(entries)):
        assert offset % torch.empty((), dtype=getattr(torch, dtype)).element_size() == 0
    buffer = flatten_bucket(tensors, entries, "cpu")
    assert buffer.dtype == torch.uint8 and buffer.numel() == bucket_nbytes(entries)
    assert buffer.numel() == sum(t.numel() * t.element_size() for t in tensors.values())  # no padding
    for name, view in bucket_views(buffer, entries):
        assert view.dtype == tensors[name].dtype and torch.equal(view, tensors[name]), name


def test_flatten_into_a_larger_buffer_and_bucket_values():
    tensors = odd_tensors()
    entries = bucket_entries((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
    out = torch.full((bucket_nbytes(entries) + 13,), 255, dtype=torch.uint8)
    assert flatten_into(out, tensors, entries) == bucket_nbytes(entries)
    assert torch.equal(out[bucket_nbytes(entries):], torch.full((13,), 255, dtype=torch.uint8))  # untouched
    bucket = Bucket.pack(list(tensors.items()))
    assert bucket.entries == entries and bucket.nbytes == bucket_nbytes(entries)
    for name, view in bucket.views():
        assert torch.equal(view, tensors[name]), name
    assert empty_bucket(entries, "cpu").numel() == bucket_nbytes(entries)
    with pytest.raises(ValueError, match="weight_specs and gather_weights disagree"):
        flatten_bucket({**tensors, "fp32": torch.randn(8)}, entries, "cpu")


def test_one_bucketer_bounds_buckets_and_keeps_order():
    sizes = [40, 30, 50, 200, 10, 10, 90]
    buckets = list(bucket_by_bytes(sizes, lambda n: n, 100))
    assert buckets == [[40, 30], [50], [200], [10, 10], [90]]  # a larger item travels alone
    assert [x for b in buckets for x in b] == sizes
    assert all(sum(b) <= 100 for b in buckets if len(b) > 1)
    assert plan_buckets([(f"t{i}", n) for i, n in enumerate(sizes)], 100)[:2] == [["t0", "t1"], ["t2"]]
    weights = [(f"w{i}", torch.zeros(8)) for i in range(3)]  # 32 bytes each
    assert [len(b) for b in bucketed(weights, 64)] == [2, 1]
    assert list(bucket_by_bytes([], len, 1)) == []
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        list(bucket_by_bytes([1], lambda n: n, 0))


def test_shared_slots_are_seen_by_every_mapping_and_leave_no_file(tmp_path):
    slots = SharedSlots.create(str(tmp_path), "t", 64)
    other = SharedSlots.open(slots.paths, 64)
    slots.unlink()
    assert not os.listdir(tmp_path)  # unlinked once every process has mapped them
    slots.slot(3, 8).copy_(torch.arange(8, dtype=torch.uint8))  # bucket 3 -> slot 1
    assert other.slot(1, 8).tolist() == list(range(8)) and other.slot(0, 8).tolist() == [0] * 8
    with pytest.raises(RuntimeError, match="does not fit the 64-byte"):
        slots.slot(0, 65)
    with pytest.raises(RuntimeError, match="do not exist"):
        SharedSlots.open(slots.paths, 64)
    with pytest.raises(RuntimeError, match="needs 2 x .* MiB"):
        SharedSlots.create(str(tmp_path), "huge", 1 << 60)
    assert not glob.glob(str(tmp_path / "*"))


def test_auto_transport_picks_nccl_on_gpus_shared_memory_on_one_node_else_the_object_store():
    assert resolve_transport("auto", {"cuda"}, same_node=True) == "broadcast"
    assert resolve_transport("auto", {"cpu"}, same_node=True) == "shared_memory"
    assert resolve_transport("auto", {"cpu", "cuda"}, same_node=True) == "shared_memory"
    assert resolve_transport("auto", {"cpu"}, same_node=False) == "object_store"
    assert resolve_transport("broadcast", {"cpu"}, same_node=False) == "broadcast"
    with pytest.raises(ValueError, match="needs every rollout process on trainer rank 0's node"):
        resolve_transport("shared_memory", {"cpu"}, same_node=False)
    with pytest.raises(ValueError, match="choose from auto, broadcast, object_store, shared_memory"):
        resolve_transport("pigeon", {"cpu"}, same_node=True)


def test_sync_handle_waits_once_and_repeats_its_error():
    calls, loaded = [], []
    handle = SyncHandle(4, lambda: calls.append(1) or {"tensors": 2}, 0.0, loaded.append)
    assert not handle.done
    first = handle.wait()
    assert handle.wait() == first and first["tensors"] == 2 and first["seconds"] > 0
    assert calls == [1] and loaded == [4] and handle.done
    failing = SyncHandle(5, lambda: 1 / 0, 0.0, loaded.append)
    for _ in range(2):
        with pytest.raises(ZeroDivisionError):
            failing.wait()
    assert loaded == [4]


def test_groups_share_a_bucket_where_their_first_name_comes():
    sizes = [("a", 4), ("q", 4), ("x", 4), ("k", 4), ("v", 4), ("b", 4)]
    plain = plan_buckets(sizes, 8)
    assert plain == [["a", "q"], ["x", "k"], ["v", "b"]]  # q/k/v spread over three buckets
    grouped = plan_buckets(sizes, 8, groups=[["q", "k", "v"]])
    assert grouped == [["a"], ["q", "k", "v"], ["x", "b"]]  # one bucket (over the bound: a group is one unit)
    assert sorted(n for b in grouped for n in b) == sorted(n for n, _ in sizes)


def test_versions_send_a_whole_group_when_one_member_changed():
    from rltrainer.weights.versions import ParamVersions

    versions = ParamVersions()
    names = ["embed", "q", "k", "v", "o", "norm"]
    versions.set_groups([["q", "k", "v"]])
    assert versions.changed(names) == names  # never synced
    versions.mark_synced(names)
    versions.bump(["q", "norm"])  # e.g. LoRA on q only: k and v did not move
    assert versions.changed(names) == ["q", "k", "v", "norm"]
    versions.mark_synced(versions.changed(names))
    versions.bump(["o"])
    assert versions.changed(names) == ["o"]

import pickle

import numpy as np
import pytest
import torch

from rltrainer.data.batch import RolloutBatch


def make(n=6, T=4):
    return RolloutBatch(
        {"x": torch.arange(n * T).view(n, T), "s": torch.arange(n).float()},
        {"text": [f"t{i}" for i in range(n)], "ids": [[i] * (i + 1) for i in range(n)]},
        meta={"k": 1},
    )


def test_fields_and_shapes():
    b = make()
    assert len(b) == 6 and set(b.keys()) == {"x", "s", "text", "ids"}
    assert b["x"].shape == (6, 4) and list(b["ids"][2]) == [2, 2, 2]
    with pytest.raises(KeyError, match="no field 'nope'"):
        b["nope"]
    with pytest.raises(ValueError, match="rows"):
        RolloutBatch({"x": torch.zeros(3)}, {"t": ["a", "b"]})


def test_index_slice_select_union():
    b = make()
    sub = b[torch.tensor([4, 1])]
    assert sub["s"].tolist() == [4.0, 1.0] and list(sub["text"]) == ["t4", "t1"] and sub.meta == {"k": 1}
    assert list(b[1:3]["text"]) == ["t1", "t2"]
    assert b.select("x", "text").keys() == ["x", "text"]
    other = RolloutBatch({"y": torch.ones(6)}, {"gt": list("abcdef")})
    u = b.union(other)
    assert "y" in u and "gt" in u and "y" not in b
    for view in (b[:], b[0:6], b[torch.arange(6)]):  # a field set on any slice stays on it
        view["z"] = torch.zeros(6)
        assert "z" not in b and "z" in view


def test_the_packed_layout_is_a_field_that_follows_the_rows():
    """``padding_free`` is a typed field (no key in ``meta``), kept by every transform and pickling."""
    b = make()
    assert not b.padding_free and "padding_free" not in b.meta
    b.padding_free = True
    kept = [b[1:3], b[[0, 2]], b[torch.tensor([4])], b.select("x"), b.copy(), b.to("cpu"), b.split(4)[1],
            RolloutBatch.concat([b, make()]), make().union(b), pickle.loads(pickle.dumps(b))]
    assert all(part.padding_free for part in kept) and "padding_free" not in b.meta
    assert not make()[1:3].padding_free and not pickle.loads(pickle.dumps(make())).padding_free


def test_every_step_value_is_a_typed_field_that_follows_the_rows():
    """Issue 45: the values the step passes along (temperature, global counts, what the rollout
    logged, ...) are typed fields, none a key in ``meta``; every transform and pickling keeps them, a
    union takes the other batch's where it sets them, and a plain checkpoint rebuilds them."""
    from rltrainer.data.batch import BATCH_FIELDS
    from rltrainer.pipelines.runs import plain_batch

    b = make()
    b.temperature, b.global_tokens, b.global_rows, b.padding = 0.0, 9.0, 2.0, True
    b.logged, b.rollout_metrics, b.reward_components = {"timing_s/gen": 0.5}, {"rollout/gen_time_s": 0.25}, ["f"]
    assert set(b.fields()) == set(BATCH_FIELDS) and b.meta == {"k": 1}
    kept = [b[1:3], b[[0, 2]], b.select("x"), b.copy(), b.to("cpu"), b.split(4)[1], RolloutBatch.concat([b, make()]),
            pickle.loads(pickle.dumps(b)), RolloutBatch(**plain_batch(b))]
    assert all(part.fields() == b.fields() for part in kept)
    merged = make().union(b)
    assert merged.temperature == 0.0 and merged.logged == b.logged and merged.padding  # 0.0 is a value: greedy
    assert b.union(make()).fields() == b.fields()  # the other's unset fields leave these


def test_repeat_chunk_split_concat():
    b = make()
    r = b.repeat(3)
    assert len(r) == 18 and list(r["text"][:4]) == ["t0", "t0", "t0", "t1"]
    assert list(b.repeat(2, interleave=False)["text"][:7]) == ["t0", "t1", "t2", "t3", "t4", "t5", "t0"]
    chunks = b.chunk(4)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert [len(p) for p in b.split(4)] == [4, 2]
    back = RolloutBatch.concat(b.split(4))
    assert torch.equal(back["x"], b["x"]) and list(back["text"]) == list(b["text"])


def test_split_by_tokens_balances_budget():
    mask = torch.zeros(5, 10, dtype=torch.long)
    for i, n in enumerate([2, 3, 9, 1, 4]):
        mask[i, :n] = 1
    b = RolloutBatch({"attention_mask": mask})
    parts = b.split_by_tokens(10)
    assert sum(len(p) for p in parts) == 5
    for p in parts:
        longest = int(p["attention_mask"].sum(-1).max())
        assert len(p) == 1 or longest * len(p) <= 10


def test_setitem_and_from_rows_checks():
    b = make()
    b["new"] = torch.zeros(6)
    b["names"] = np.array(["a"] * 6)
    with pytest.raises(ValueError, match="has 2 rows"):
        b["bad"] = torch.zeros(2)
    rb = RolloutBatch.from_rows([{"a": 1, "b": 2}, {"a": 3, "b": 4}])
    assert list(rb["a"]) == [1, 3]
    with pytest.raises(ValueError, match="Row 1 has fields"):
        RolloutBatch.from_rows([{"a": 1}, {"b": 2}])


def test_pickles_through_numpy_and_ray_object_store(ray_session):
    import pickle

    batch = make(n=512, T=512)  # 2 MiB: Ray stores it out of band and hands back a read-only view
    batch["bf16"] = torch.ones(len(batch), 2, dtype=torch.bfloat16)
    batch.temperature = 0.7
    for copy in (pickle.loads(pickle.dumps(batch)), ray_session.get(ray_session.put(batch))):
        assert copy.keys() == batch.keys() and copy.meta == batch.meta and copy.temperature == 0.7
        for key in batch.tensors.keys():
            assert copy[key].dtype == batch[key].dtype and torch.equal(copy[key], batch[key])
        copy["x"].add_(1)  # writable: no read-only view of the object store leaks out
    assert list(copy["ids"][3]) == [3] * 4

"""Split placement's broadcast weight transport on CPU (gloo): the wire format, the group itself
(and SGLang's own receiving code, read from its wheel), FSDP2 on 2 ranks syncing 1 and 2 ``hf``
replicas bit-exactly and only what changed, the SGLang adapter's protocol against a recording
fake, and failures that raise in the controller instead of hanging."""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import textwrap
import threading
import time
import uuid
import zipfile
from pathlib import Path

import pytest
import torch

from rltrainer import GRPO, Trainer, prompt_dataloader
from rltrainer.controller import WorkerError
from rltrainer.rollout.rollout import Rollout
from rltrainer.rollout.sglang import SGLangEngine
from rltrainer.strategies import FSDP2Strategy
from rltrainer.weights.group import WeightGroup
from rltrainer.weights.wire import bucket_entries, bucket_views, empty_bucket, flatten_bucket
from rltrainer.testing import FrozenEmbeddingGRPO, length_reward

ROOT = Path(__file__).resolve().parents[2]
WHEELS = Path(os.environ.get("RLTRAINER_WHEELS_DIR", ROOT / "tests" / "rollout" / "wheels"))
FROZEN = ["model.embed_tokens.weight"]


def make_module(config, tokenizer):
    return FrozenEmbeddingGRPO(config, tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8,
                               lr=1e-2, kl_coef=0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def run_together(*fns, timeout: float = 30.0) -> list:
    """Run ``fns`` in threads at once (members of one group); re-raise the first error."""
    results, errors = [None] * len(fns), []

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a group member hung"
    if errors:
        raise errors[0]
    return results


# -- the transport, in one process ----------------------------------------------------------------
def test_wire_format_orders_by_element_size_and_round_trips():
    tensors = {"half": torch.randn(3, 5).to(torch.bfloat16), "float": torch.randn(7), "scalar": torch.tensor(2.5),
               "long": torch.arange(4).reshape(2, 2), "odd": torch.randn(3).to(torch.float16)}
    entries = bucket_entries((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
    assert [e[0] for e in entries] == ["long", "float", "scalar", "half", "odd"]  # 8, 4, 4, 2, 2 bytes: aligned
    assert entries[0] == ("long", "int64", (2, 2)) and entries[2] == ("scalar", "float32", ())
    buffer = flatten_bucket(tensors, entries, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, view in bucket_views(buffer, entries):
        assert torch.equal(view, tensors[name]) and view.dtype == tensors[name].dtype, name
    with pytest.raises(ValueError, match="weight_specs and gather_weights disagree"):
        flatten_bucket({**tensors, "float": torch.randn(8)}, entries, torch.device("cpu"))


def test_weight_group_broadcasts_to_every_member():
    tensors = {"w": torch.randn(4, 3), "b": torch.randn(3).to(torch.bfloat16)}
    entries = bucket_entries((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
    port, name, received = free_port(), f"test-{uuid.uuid4().hex[:8]}", {}

    def member(rank):
        group = WeightGroup("127.0.0.1", port, rank, 3, name, "gloo", timeout_s=20)
        try:
            for step in range(2):  # two buckets through the same group
                if rank == 0:
                    buffer = flatten_bucket(tensors, entries, torch.device("cpu"))
                else:
                    buffer = empty_bucket(entries, "cpu")
                group.broadcast(buffer)
                received[rank, step] = dict(bucket_views(buffer, entries))
        finally:
            group.close()

    run_together(*(lambda r=r: member(r) for r in range(3)))
    for (rank, step), views in received.items():
        for key, tensor in tensors.items():
            assert torch.equal(views[key], tensor), (rank, step, key)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per member: 2 CUDA devices")
def test_weight_group_over_nccl():
    tensors = {"w": torch.randn(64, 32).to(torch.bfloat16), "b": torch.randn(32)}
    entries = bucket_entries((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
    port, name = free_port(), f"test-{uuid.uuid4().hex[:8]}"

    def member(rank):
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        group = WeightGroup("127.0.0.1", port, rank, 2, name, "nccl", timeout_s=60)
        buffer = flatten_bucket(tensors, entries, device) if rank == 0 else empty_bucket(entries, device)
        group.broadcast(buffer)
        group.close()
        return {n: t.cpu() for n, t in bucket_views(buffer, entries)}

    for views in run_together(lambda: member(0), lambda: member(1), timeout=120):
        for key, tensor in tensors.items():
            assert torch.equal(views[key], tensor), key


def test_weight_group_times_out_when_a_member_never_joins():
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"rank 0 of 2 could not form the group within 1 s. A member did not join"):
        WeightGroup("127.0.0.1", free_port(), 0, 2, "lonely", "gloo", timeout_s=1)
    assert time.perf_counter() - start < 15
    with pytest.raises(ValueError, match="choose from nccl, gloo"):
        WeightGroup("127.0.0.1", free_port(), 0, 1, "x", "mpi")


def _sglang_source(path: str, function: str, wheel: zipfile.ZipFile) -> str:
    text = wheel.read(path).decode()
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == function)
    return "from __future__ import annotations\n" + textwrap.dedent(ast.get_source_segment(text, node))


def test_sglang_receiving_code_from_its_wheel_joins_and_decodes_our_broadcast():
    """SGLang 0.5.23's own ``init_custom_process_group`` and flattened-bucket receive (read from the
    wheel, run here on gloo) against our sender: the store layout, the handshake and the byte
    layout agree. The real path (NCCL, SGLang's scheduler processes) needs a GPU."""
    wheels = sorted(WHEELS.glob("sglang-0.5.23-*.whl"))
    if not wheels:
        pytest.skip(f"no sglang==0.5.23 wheel in {WHEELS} (set RLTRAINER_WHEELS_DIR)")
    import torch.distributed as dist

    wheel = zipfile.ZipFile(wheels[-1])
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    sglang: dict = {"torch": torch, "torch_release": release}
    exec(wheel.read("sglang/srt/weight_sync/tensor_bucket.py").decode(), sglang)  # FlattenedTensorBucket
    exec(_sglang_source("sglang/srt/utils/common.py", "init_custom_process_group", wheel), sglang)
    exec(_sglang_source("sglang/srt/model_executor/model_runner_components/weight_updater.py",
                        "_receive_bucketed_weights_from_distributed", wheel), sglang)

    tensors = {"q": torch.randn(2, 3).to(torch.bfloat16), "n": torch.randn(5), "i": torch.arange(3)}
    entries = bucket_entries((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
    port, name = free_port(), f"rltrainer-weights-{uuid.uuid4().hex[:8]}"

    def ours():
        group = WeightGroup("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=20)
        group.broadcast(flatten_bucket(tensors, entries, torch.device("cpu")))
        group.close()

    def theirs():  # what one SGLang TP scheduler does (rank = rank_offset + tp_rank = 1)
        pg = sglang["init_custom_process_group"](backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                                 rank=1, group_name=name)
        runner = type("WeightUpdater", (), {"_model_update_group": {name: pg}, "device": "cpu"})()
        try:
            return sglang["_receive_bucketed_weights_from_distributed"](
                runner, names=[e[0] for e in entries], dtypes=[e[1] for e in entries],
                shapes=[list(e[2]) for e in entries], group_name=name)
        finally:
            dist.destroy_process_group(pg)

    _, received = run_together(ours, theirs)
    assert [n for n, _ in received] == [e[0] for e in entries]
    for key, tensor in received:
        assert torch.equal(tensor, tensors[key]) and tensor.dtype == tensors[key].dtype, key


# -- FSDP2 with split placement ------------------------------------------------------------------
@pytest.mark.parametrize("replicas", [1, 2])
def test_split_fit_syncs_changed_weights_bit_exactly_then_a_dead_replica_raises(
        replicas, tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    """FSDP2 on 2 ranks, ``hf`` replicas: after a step only the changed tensors (not the frozen
    embedding) were broadcast, in several buckets, and every replica equals the policy bit for bit.
    Then a replica dies: the next sync raises in the controller, naming it, instead of hanging."""
    strategy = FSDP2Strategy(devices=2, micro_batch_size=4)
    rollout = Rollout(placement="split", replicas=replicas, transport="broadcast", bucket_bytes=64 << 10)
    trainer = Trainer(strategy=strategy, rollout=rollout, max_steps=1, logger=False, enable_progress_bar=False, seed=3)
    with trainer:
        trainer.fit(make_module(tiny_config, bpe_tokenizer), prompt_dataloader(gsm8k_prompts, batch_size=2))
        assert trainer.sync.transport is not None and trainer.sync.transport.backend == "gloo"
        assert trainer.sync.transport.world_size == 1 + replicas
        m = trainer.callback_metrics
        names = strategy.weight_names()
        assert m["sync/skipped"] == len(FROZEN) and m["sync/tensors"] == len(names) - len(FROZEN)
        assert m["sync/buckets"] > 1  # 64 KiB buckets: more than one broadcast
        full = dict(strategy.export_weights())
        assert m["sync/bytes"] == sum(t.numel() * t.element_size() for n, t in full.items() if n not in FROZEN)
        replicas_weights = rollout.group.execute_all("engine_weights")
        assert len(replicas_weights) == replicas
        for weights in replicas_weights:
            for name, tensor in full.items():
                assert torch.equal(weights[name], tensor), name
        again = trainer.sync.push(mode="wait")  # nothing changed since: nothing sent
        assert again["sync/tensors"] == 0 and again["sync/buckets"] == 0 and again["sync/skipped"] == len(names)

        os.kill(rollout.group.pids[0], signal.SIGKILL)
        strategy.group.execute_all("forget_synced")  # the next sync sends everything
        start = time.perf_counter()
        with pytest.raises(WorkerError) as info:
            trainer.sync.push(mode="wait")
        assert time.perf_counter() - start < 20
        assert "rollout[rank 0]" in str(info.value) and "died" in str(info.value)
        assert any("'actor'" in note for note in info.value.__notes__)  # trainer rank 0 was blocked: shut down


def test_bad_transport_lists_the_choices():
    with pytest.raises(ValueError, match="transport='pigeon'; choose from auto, broadcast, object_store"):
        Rollout(placement="split", transport="pigeon")


# -- SGLang's side, against a recording fake ------------------------------------------------------
class RecordingSGLang:
    """Stands in for ``sglang.Engine`` (the real one needs a GPU): records every control call to a
    JSON-lines file, and plays SGLang's TP scheduler processes with threads that join the group as
    ranks ``rank_offset + tp_rank`` and receive each flattened bucket into a transformers model."""

    def __init__(self, model: torch.nn.Module, tp_size: int, log_path: str) -> None:
        self.model, self.tp_size, self.log_path = model, tp_size, log_path
        self.groups: list[WeightGroup] = []

    def _record(self, call: str, **kwargs) -> tuple[bool, str]:
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"call": call, **kwargs}) + "\n")
        return True, "Success"

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        self.groups = run_together(*(lambda r=r: WeightGroup(master_address, master_port, rank_offset + r, world_size,
                                                             group_name, backend, timeout_s=30)
                                     for r in range(self.tp_size)))
        return self._record("init_weights_update_group", rank_offset=rank_offset, world_size=world_size,
                            group_name=group_name, backend=backend)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        entries = [(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes)]

        def receive(group):
            buffer = empty_bucket(entries, "cpu")
            group.broadcast(buffer)
            return buffer

        buffers = run_together(*(lambda g=g: receive(g) for g in self.groups))
        assert all(torch.equal(b, buffers[0]) for b in buffers)  # every TP rank got the whole bucket
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, view in bucket_views(buffers[0], entries):
                params[name].copy_(view)
        return self._record("update_weights_from_distributed", names=names, dtypes=dtypes, shapes=shapes,
                            group_name=group_name, flush_cache=flush_cache, load_format=load_format)

    def begin_weight_update(self):
        return self._record("begin_weight_update")

    def end_weight_update(self):
        return self._record("end_weight_update")

    def flush_cache(self):
        return self._record("flush_cache")

    def destroy_weights_update_group(self, group_name):
        for group in self.groups:
            group.close()
        return self._record("destroy_weights_update_group", group_name=group_name)

    def shutdown(self):
        pass


class RecordingSGLangEngine(SGLangEngine):
    """Our SGLang adapter with :class:`RecordingSGLang` in place of ``sglang.Engine``."""

    def __init__(self, log_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.log_dir = log_dir

    def setup(self, model_config, tokenizer, device=None):
        from transformers import AutoModelForCausalLM

        self.tokenizer = tokenizer
        self.model = AutoModelForCausalLM.from_config(model_config, dtype=self.dtype)  # read by engine_weights
        self.engine = RecordingSGLang(self.model, self.tp_size, os.path.join(self.log_dir, f"{os.getpid()}.jsonl"))


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
def test_sglang_split_protocol_against_a_recording_engine(tiny_config, bpe_tokenizer, ray_session, tmp_path):
    """2 replicas of tp_size 2 (threads standing in for SGLang's schedulers): group ranks 1-2 and
    3-4, one ``update_weights_from_distributed`` per bucket inside one begin/end session, bf16
    dtype names, the cache flushed with the last bucket only. One training rank, so the sender
    is this process (the receivers' calls must be issued first). The real SGLang needs a GPU."""
    strategy = FSDP2Strategy(devices=1)
    rollout = Rollout(RecordingSGLangEngine(str(tmp_path), tp_size=2), placement="split", replicas=2,
                      transport="broadcast", bucket_bytes=64 << 10)
    try:
        strategy.setup(make_module(tiny_config, bpe_tokenizer), seed=0)  # one rank: this process sends
        sync = rollout.connect(strategy, bpe_tokenizer)
        stats = sync.push(0, mode="wait")
        assert sync.push(mode="wait")["sync/buckets"] == 0  # nothing changed: no session at all
        expected = dict(strategy.export_weights(dtype=torch.bfloat16))
        for weights in rollout.group.execute_all("engine_weights"):
            for name, tensor in expected.items():
                assert torch.equal(weights[name], tensor), name
        sync.engine.teardown()  # the replicas leave the group
    finally:
        rollout.teardown()
        strategy.teardown()
    logs = [[json.loads(line) for line in path.read_text().splitlines()] for path in sorted(tmp_path.iterdir())]
    assert len(logs) == 2
    inits = sorted((calls[0] for calls in logs), key=lambda c: c["rank_offset"])
    assert [c["rank_offset"] for c in inits] == [1, 3] and {c["world_size"] for c in inits} == {5}
    assert {c["backend"] for c in inits} == {"gloo"} and len({c["group_name"] for c in inits}) == 1
    group_name = inits[0]["group_name"]
    for calls in logs:
        kinds = [c["call"] for c in calls]
        updates = [c for c in calls if c["call"] == "update_weights_from_distributed"]
        assert kinds == (["init_weights_update_group", "begin_weight_update"] + ["update_weights_from_distributed"]
                         * int(stats["sync/buckets"]) + ["end_weight_update", "destroy_weights_update_group"])
        assert [c["flush_cache"] for c in updates] == [False] * (len(updates) - 1) + [True]
        assert {c["load_format"] for c in updates} == {"flattened_bucket"}
        assert {c["group_name"] for c in updates} == {group_name}
        assert {d for c in updates for d in c["dtypes"]} == {"bfloat16"}
        sent = {n: s for c in updates for n, s in zip(c["names"], c["shapes"])}
        assert sent == {n: list(t.shape) for n, t in expected.items()}
    assert stats["sync/tensors"] == len(expected) and stats["sync/skipped"] == 0


@pytest.mark.usefixtures("warm_ranks")
def test_sglang_lora_over_the_broadcast_is_refused_before_a_replica_starts(tiny_config, bpe_tokenizer, ray_session,
                                                                           tmp_path):
    """Issue 30.13b: SGLang's broadcast receive loads base weights only, so a LoRA policy's adapter
    cannot travel by it. That used to be refused at the first sync, after every replica had started
    SGLang and joined the group (with one training rank, this process waits in the group's rendezvous
    for the refusing replica until the timeout); now ``Rollout.connect`` refuses as soon as the
    transport is resolved, before any replica sets its engine up."""
    import peft

    class MarkingEngine(RecordingSGLangEngine):
        def setup(self, model_config, tokenizer, device=None):
            Path(self.log_dir, f"setup-{os.getpid()}").touch()
            super().setup(model_config, tokenizer, device)

    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8,
                  lora=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    strategy = FSDP2Strategy(devices=1)
    rollout = Rollout(MarkingEngine(str(tmp_path), enable_lora=True), placement="split", replicas=1,
                      transport="broadcast")
    try:
        strategy.setup(module, seed=0)
        with pytest.raises(ValueError, match=r"SGLangEngine\(enable_lora=True\) .*\(Rollout\(transport='broadcast'\)"):
            rollout.connect(strategy, bpe_tokenizer)
        assert not list(tmp_path.iterdir())  # no replica started its engine
    finally:
        rollout.teardown()
        strategy.teardown()

"""FSDP2 on CPU (gloo): 2 Ray ranks equal 1 device, weight sync is exact and sends only what
changed, a dead worker is an error in the driver, not a hang."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from rltrainer import GRPO, SyncPipeline, Trainer, prompt_dataloader
from rltrainer.checkpoints import CheckpointError
from rltrainer.controller import WorkerError
from rltrainer.data.batch import RolloutBatch
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy, SingleDeviceStrategy
from rltrainer.strategies.dispatch import partition_for_ranks
from rltrainer.testing import FrozenEmbeddingGRPO, length_reward, prepared_batch, scribble, tiny_qwen3_config


class DyingGRPO(GRPO):
    """Rank 1 kills its own process (SIGKILL, no Python cleanup) in the second step's update."""

    calls = 0  # per process

    def policy_step(self, micro_batch):
        import torch.distributed as dist

        DyingGRPO.calls += 1
        if dist.get_rank() == 1 and DyingGRPO.calls == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().policy_step(micro_batch)


def make_module(cls, config, tokenizer, **kwargs):
    # lr 1e-4: the tests below compare layouts after AdamW steps. Adam's first step is lr * g / (|g| + eps),
    # so a rounding difference d in a gradient entry near zero (|g| ~ eps = 1e-8) moves that weight by up
    # to lr * d / eps. With d ~ u * sum|terms| ~ 6e-8 * 1e-4 = 6e-12, two steps give 2 * lr * 6e-4. Seen:
    # at lr 1e-3 one embedding entry of 131,072 (and one o_proj entry) off by 1.0-1.5e-5 once the padded
    # path left out all-padding columns (the 1-device and 2-rank micro-batches then have different widths,
    # so different roundings): over the 1e-5 the tests allow. At 1e-4 that is 1.5e-6; a wrong layout still
    # moves a weight by ~lr = 1e-4 a step.
    defaults = dict(reward_funcs=length_reward, num_generations=4, max_new_tokens=8, lr=1e-4, kl_coef=0.05,
                    entropy_coef=0.01)
    return cls(config, tokenizer, **{**defaults, **kwargs})


def test_partition_balances_tokens_and_pads_to_equal_micro_batch_counts():
    mask = torch.zeros(5, 10, dtype=torch.long)
    for i, n in enumerate([10, 1, 9, 2, 3]):
        mask[i, :n] = 1
    batch = RolloutBatch({"attention_mask": mask, "response_mask": mask.clone(), "x": torch.arange(5)})
    parts, rows = partition_for_ranks(batch, 2, micro_batch_size=1, max_tokens=None)
    assert sorted(torch.cat(rows).tolist()) == list(range(5))
    loads = [int(mask[r].sum()) for r in rows]
    assert abs(loads[0] - loads[1]) <= 3  # 13 vs 12 tokens, not 21 vs 4
    assert len(parts[0]) == len(parts[1]) == 3
    padding = [mb for p in parts for mb in p if mb.padding]
    assert len(padding) == 1 and int(padding[0]["response_mask"].sum()) == 0
    # more ranks than rows: the empty rank runs padding only
    parts, rows = partition_for_ranks(batch[[0]], 2, micro_batch_size=4, max_tokens=None)
    assert len(parts[0]) == len(parts[1]) == 1 and len(rows[1]) == 0
    # token budget: each rank splits by tokens, counts still equal
    parts, _ = partition_for_ranks(batch, 2, micro_batch_size=8, max_tokens=20)
    assert len(parts[0]) == len(parts[1])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_two_ranks_on_ray_match_one_device(family, tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    if family == "qwen3":  # qk-norm weights (16 rows) and q_proj (64 x 32) shard across the 2 ranks too
        tiny_config = tiny_qwen3_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)
    prompts = RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(3)])
    single_module = make_module(GRPO, tiny_config, bpe_tokenizer)
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=8)
    single.setup(single_module, seed=7)
    torch.manual_seed(0)
    batch = prepared_batch(single_module, single, prompts)  # 12 rows
    assert batch["advantages"].abs().sum() > 0

    fsdp = FSDP2Strategy(devices=2, micro_batch_size=5)  # 6 rows per rank -> 2 micro-batches each, one short
    try:
        fsdp.setup(make_module(GRPO, tiny_config, bpe_tokenizer), seed=7)
        before = dict(fsdp.export_weights())
        for name, p in single_module.policy.named_parameters():
            assert torch.equal(before[name], p.detach()), name  # same seed, same init on every rank
        # rank 0 ran the random init in full; rank 1 built on meta and received only its rows
        report = fsdp.group.execute_all("load_report")[1]["policy"]
        assert report["source"] == "random init on rank 0"
        assert report["loaded_bytes"] == report["shard_bytes"] < 0.6 * report["full_bytes"]
        for stage in ("ref",):
            torch.testing.assert_close(fsdp.compute(batch, stage)[f"{stage}_log_probs"], batch["ref_log_probs"],
                                       rtol=0, atol=1e-5)
        for _ in range(2):
            m_single = single.train_step(batch)
            m_fsdp = fsdp.train_step(batch)
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert m_fsdp[key] == pytest.approx(m_single[key], rel=1e-4, abs=1e-6), key
        after = dict(fsdp.export_weights())
        moved = 0
        for name, p in single_module.policy.named_parameters():
            torch.testing.assert_close(after[name], p.detach(), rtol=0, atol=1e-5, msg=name)
            moved += not torch.equal(after[name], before[name])
        assert moved == len(after)  # every tensor took the step
    finally:
        fsdp.teardown()


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_sync_is_bit_exact_and_skips_frozen(placement, tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    module = make_module(FrozenEmbeddingGRPO, tiny_config, bpe_tokenizer, num_generations=2)
    # split: the object store here (broadcast: tests/weights/test_split_broadcast.py; shared memory, which
    # "auto" picks on one CPU node: tests/weights/test_shared_memory_sync.py)
    strategy = FSDP2Strategy(devices=2, micro_batch_size=4)
    rollout = Rollout(placement=placement, bucket_bytes=64 << 10, transport="object_store")
    trainer = Trainer(strategy=strategy, rollout=rollout, max_steps=2, logger=False, enable_progress_bar=False, seed=3)
    with trainer:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
        m = trainer.callback_metrics
        names = strategy.weight_names()
        assert trainer.sync.transport.name == ("colocated" if placement == "colocated" else "object_store")
        frozen = ["model.embed_tokens.weight"]
        assert m["sync/skipped"] == len(frozen) and m["sync/tensors"] == len(names) - len(frozen)
        assert m["sync/buckets"] > 1  # 64 KiB buckets: the transfer really is bucketed
        full = dict(strategy.export_weights())
        frozen_bytes = sum(full[n].numel() * full[n].element_size() for n in frozen)
        total_bytes = sum(t.numel() * t.element_size() for t in full.values())
        assert m["sync/bytes"] == total_bytes - frozen_bytes
        group = rollout.group if placement == "split" else strategy.group
        replicas = group.execute_all("engine_weights")
        assert len(replicas) == (1 if placement == "split" else 2)
        for replica in replicas:
            for name, tensor in full.items():
                assert torch.equal(replica[name], tensor), name
        assert set(group.execute_all("engine_weight_version")) == {trainer.sync.version}
        assert trainer.sync.version >= 1  # the last sync carried a trained version
        # the controller can also push tensors of its own to every replica
        norm = torch.full_like(full["model.norm.weight"], 0.5)
        assert trainer.engine.update_weights([("model.norm.weight", norm)])["tensors"] == 1
        assert all(torch.equal(r["model.norm.weight"], norm) for r in group.execute_all("engine_weights"))
    assert strategy.group is None  # the with-block released the workers


def test_dead_worker_raises_in_driver(tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    module = make_module(DyingGRPO, tiny_config, bpe_tokenizer, num_generations=2)
    trainer = Trainer(strategy=FSDP2Strategy(devices=2), max_steps=3, logger=False, enable_progress_bar=False)
    start = time.perf_counter()
    with pytest.raises(WorkerError) as info:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    elapsed = time.perf_counter() - start
    assert "rank 1" in str(info.value) and "train_step" in str(info.value) and "died" in str(info.value)
    assert elapsed < 60  # includes starting the workers; the failure itself surfaces in seconds
    assert trainer.strategy.group is None  # fit tore the group down


def test_one_rank_runs_in_process_like_single(tiny_config, bpe_tokenizer, gsm8k_prompts):
    """devices=1: no Ray, the worker lives in this process; the result equals the single strategy."""
    results = {}
    for name, strategy in (("single", SingleDeviceStrategy(device="cpu")), ("fsdp2", FSDP2Strategy(devices=1))):
        module = make_module(GRPO, tiny_config, bpe_tokenizer, num_generations=2)
        with Trainer(strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False, seed=5) as trainer:
            trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
            results[name] = dict(strategy.export_weights())
    for name, tensor in results["single"].items():
        torch.testing.assert_close(results["fsdp2"][name], tensor, rtol=0, atol=1e-5, msg=name)


def test_a_background_push_gives_the_same_run(tiny_config, bpe_tokenizer, gsm8k_prompts):
    results = {}
    for mode in ("wait", "background"):
        module = make_module(FrozenEmbeddingGRPO, tiny_config, bpe_tokenizer, num_generations=2)
        trainer = Trainer(max_steps=3, logger=False, enable_progress_bar=False, seed=2,
                          pipeline=SyncPipeline(push_mode=mode))
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
        results[mode] = ({n: p.detach().clone() for n, p in module.policy.named_parameters()},
                         trainer.callback_metrics)
        engine = {n: p for n, p in trainer.engine.model.named_parameters()}
        for n, p in module.policy.named_parameters():
            assert torch.equal(engine[n], p), n  # fit returns with the last push done
    for name, tensor in results["wait"][0].items():
        assert torch.equal(results["background"][0][name], tensor), name
    assert "timing_s/wait_weights" in results["background"][1] and results["background"][1]["sync/skipped"] == 1
    with pytest.raises(ValueError, match="push_mode"):
        Trainer(pipeline=SyncPipeline(push_mode="later"))


def test_bad_fsdp2_and_rollout_arguments():
    with pytest.raises(ValueError, match="placement"):
        Rollout(placement="elsewhere")
    with pytest.raises(ValueError, match="devices"):
        FSDP2Strategy(devices=0)
    with pytest.raises(ValueError, match="replicas"):
        Rollout(replicas=0)


@pytest.mark.parametrize("preset", ["fsdp2_offload", "fsdp2_checkpointing"])
def test_offload_and_checkpointing_presets_match_plain_fsdp2(preset, tiny_config, bpe_tokenizer, gsm8k_prompts):
    results = {}
    for name in ("fsdp2", preset):
        module = make_module(GRPO, tiny_config, bpe_tokenizer, num_generations=2)
        with Trainer(strategy=name, max_steps=1, logger=False, enable_progress_bar=False, seed=4) as trainer:
            trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
            results[name] = dict(trainer.strategy.export_weights())
    for name, tensor in results["fsdp2"].items():
        torch.testing.assert_close(results[preset][name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("devices", [1, 2])
def test_fsdp2_checkpoint_resume_matches_uninterrupted_run(devices, tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path,
                                                           ray_session):
    """devices=2: each rank writes and reads its own shards, and every rank's RNG (its engine samples) is restored."""
    def run(max_steps, ckpt=None, save=None):
        module = make_module(GRPO, tiny_config, bpe_tokenizer, num_generations=2)
        with Trainer(strategy="fsdp2", devices=devices, max_steps=max_steps, logger=False, enable_progress_bar=False, seed=6,
                     default_root_dir=tmp_path) as trainer:
            trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2), ckpt_path=ckpt)
            if save:
                trainer.save_checkpoint(save)
            return dict(trainer.strategy.export_weights())

    full = run(3)
    run(1, save=tmp_path / "step1.ckpt")
    resumed = run(3, ckpt=tmp_path / "step1.ckpt")
    for name, tensor in full.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=name)


def assert_same_state(a, b, where="state"):
    """Nested dicts / lists of tensors and numbers, equal exactly."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(set(a) ^ set(b))[:4])
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# This module's tests start fresh rank processes (no warm_ranks). In reused warm ones, after the other
# FSDP2 tests had run there, this test's 2-rank state and the checkpoint loaded on 1 device differed, and
# in CI the 2-rank checkpoint-resume test's DCP save failed its global-plan check (half the chunks):
# state of an earlier setup survives in the process (2026-12-02, cause not found).
def test_fsdp2_sharded_checkpoint_reshards_2_to_1_and_1_to_2(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path,
                                                             ray_session):
    """Each rank writes its own torch.distributed.checkpoint shards (the controller only its small
    state); a checkpoint saved on 2 ranks loads on 1 and one saved on 1 loads on 2, with the same
    weights and optimizer state (compared in full, gathered after loading)."""
    def run(devices, ckpt=None, save=None):
        module = make_module(GRPO, tiny_config, bpe_tokenizer, num_generations=2)
        with Trainer(strategy="fsdp2", devices=devices, max_steps=1, logger=False, enable_progress_bar=False, seed=6,
                     default_root_dir=tmp_path) as trainer:
            trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2), ckpt_path=ckpt)
            assert trainer.global_step == 1
            if save:
                trainer.save_checkpoint(save)
            return trainer.strategy.state_dict()["training"]  # full models and optimizer states

    trained = run(2, save=tmp_path / "two.ckpt")
    assert trained["optimizers"][0]["state"]  # Adam moments exist: the step ran
    shards = sorted(p.name for p in (tmp_path / "two.ckpt" / "training").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank, nothing gathered
    assert_same_state(trained, run(1, ckpt=tmp_path / "two.ckpt", save=tmp_path / "one.ckpt"), "2 -> 1")
    assert_same_state(trained, run(2, ckpt=tmp_path / "one.ckpt"), "1 -> 2")


def test_fsdp2_ranks_checksum_their_shards_and_a_corrupt_one_is_named(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                      tmp_path, ray_session, monkeypatch):
    """Each rank hashes the DCP files it wrote (the controller only its trainer.pt: it reads no shard),
    checksums.json lists them all, and at load the ranks check them before DCP reads anything: random
    bytes in a shard or the metadata raise a CheckpointError naming the file."""
    from rltrainer import checkpoints

    hashed = []
    digest = checkpoints.file_digest
    monkeypatch.setattr(checkpoints, "file_digest", lambda path: hashed.append(Path(path).name) or digest(path))

    def run(ckpt=None, save=None):
        module = make_module(GRPO, tiny_config, bpe_tokenizer, num_generations=2)
        with Trainer(strategy="fsdp2", devices=2, max_steps=1, logger=False, enable_progress_bar=False, seed=6,
                     default_root_dir=tmp_path) as trainer:
            trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2), ckpt_path=ckpt)
            if save:
                trainer.save_checkpoint(save)

    run(save=tmp_path / "two.ckpt")
    assert hashed == ["trainer.pt"]  # by this process; the shards by their ranks
    files = json.loads((tmp_path / "two.ckpt" / checkpoints.MANIFEST).read_text())["files"]
    assert sorted(files) == ["trainer.pt", "training/.metadata", "training/__0_0.distcp", "training/__1_0.distcp"]
    for part in ("__1_0.distcp", ".metadata"):
        bad = tmp_path / f"bad{part}.ckpt"
        shutil.copytree(tmp_path / "two.ckpt", bad)
        scribble(bad / "training" / part)
        hashed.clear()
        with pytest.raises(CheckpointError) as info:
            run(ckpt=bad)
        assert str(info.value).startswith(f"{bad}/training/{part} is corrupted: its sha256 is "), str(info.value)
        assert files[f"training/{part}"] in str(info.value) and set(hashed) == {"trainer.pt"}


# Fresh rank processes (no warm_ranks), as the rest of this module
def test_fsdp2_async_checkpoint_completes_at_the_next_save_and_at_the_end_of_fit(tiny_config, bpe_tokenizer,
                                                                                gsm8k_prompts, tmp_path, ray_session):
    """ModelCheckpoint(async_save=True): step 1's shards are written in the background during step
    2 (not visible yet, only its temporary directory); the next save completes it, the end of fit
    completes the last one, and it loads with the state training ended with."""
    from rltrainer import Callback, ModelCheckpoint

    checkpoints = tmp_path / "checkpoints"
    seen = []

    class Look(Callback):
        def on_step_end(self, trainer, module, metrics):
            seen.append((trainer.global_step, sorted(p.name.split(".tmp-")[0] for p in checkpoints.glob("*"))))

    def run(max_steps, ckpt=None, callbacks=()):
        module = make_module(GRPO, tiny_config, bpe_tokenizer, num_generations=2)
        with Trainer(strategy="fsdp2", devices=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
                     seed=6, default_root_dir=tmp_path, callbacks=list(callbacks)) as trainer:
            trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2), ckpt_path=ckpt)
            return trainer.strategy.state_dict()["training"]

    trained = run(2, callbacks=[Look(), ModelCheckpoint(every_n_steps=1, async_save=True)])
    assert seen == [(1, []), (2, [".step=1.ckpt"])]  # during step 2, step 1 was still being written
    assert os.readlink(checkpoints / "last.ckpt") == "step=2.ckpt" and not (checkpoints / "step=1.ckpt").exists()
    assert not list(checkpoints.glob(".*"))
    assert_same_state(trained, run(2, ckpt="last"), "async checkpoint")


def test_ray_started_by_the_strategy_shuts_down_after_fit(tmp_path):
    """A script with no Ray running: fit on 2 ranks, leave the with-block, exit cleanly and fast."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import os, torch, ray\n"
        "os.environ.setdefault('RAY_AUTH_MODE', 'disabled')\n"
        "from rltrainer import GRPO, Trainer, prompt_dataloader\n"
        "from rltrainer.data import load_rows, prepare_gsm8k\n"
        "from rltrainer.testing import data_path, load_tokenizer, tiny_qwen2_config\n"
        "tok = load_tokenizer('gsm8k-bpe4k')\n"
        "rows = load_rows(str(data_path('gsm8k', 'train.jsonl'))).select(range(4))\n"
        "data = prepare_gsm8k(rows, tok, max_prompt_length=160)\n"
        "module = GRPO(tiny_qwen2_config(len(tok), hidden_size=32, num_layers=2), tok, reward_funcs='gsm8k',\n"
        "              num_generations=2, max_new_tokens=4)\n"
        "with Trainer(strategy='fsdp2', devices=2, max_steps=1, logger=False, enable_progress_bar=False) as t:\n"
        "    t.fit(module, prompt_dataloader(data, batch_size=2))\n"
        "assert not ray.is_initialized(), 'Ray still running after teardown'\n"
        "print('CLEAN EXIT')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0 and "CLEAN EXIT" in proc.stdout, proc.stderr[-3000:]
    assert time.perf_counter() - start < 120


def test_too_few_ray_resources_fail_fast_with_what_is_there(tiny_config, bpe_tokenizer, ray_session):
    strategy = FSDP2Strategy(devices=2, cpus_per_worker=64)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"need \{'CPU': 128\}, but the whole Ray cluster has 4 CPU"):
        strategy.setup(make_module(GRPO, tiny_config, bpe_tokenizer), seed=0)
    assert time.perf_counter() - start < 10  # no waiting for resources that cannot exist


def _offloaded_clip_rank(rank: int, port: int, out: str) -> None:
    """Rank ``rank`` of 2 under NCCL's rule: a mesh over the default group, whose gradients are CPU
    shards (cpu_offload on a GPU: the mesh's group is NCCL)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from rltrainer.strategies.fsdp2.worker import FSDP2Worker
    from rltrainer.testing.nccl_rule import nccl_rule

    torch.set_num_threads(1)
    full = [torch.arange(12.0).reshape(6, 2), torch.linspace(-3, 3, 5)]  # 5 rows: rank 1's shard is shorter
    with nccl_rule():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        params = []
        for tensor in full:
            rows = tensor.chunk(2)[rank]
            param = torch.nn.Parameter(DTensor.from_local(torch.zeros_like(rows), mesh, [Shard(0)], run_check=False))
            param.grad = DTensor.from_local(rows.clone(), mesh, [Shard(0)], run_check=False)
            params.append(param)
        worker = FSDP2Worker(rank, 2, device="cpu")
        worker.options = {"cpu_offload": True}
        norm = worker.clip_gradients(params, max_norm=1.0)
        torch.save((norm, [p.grad.to_local() for p in params]), f"{out}.{rank}")
        dist.barrier()
        dist.destroy_process_group()


def test_offloaded_gradients_clip_where_the_mesh_group_refuses_cpu_tensors(tmp_path):
    """cpu_offload on a GPU: the gradients are CPU shards of a mesh whose group is NCCL, which
    refuses CPU tensors; torch's clip_grad_norm_ all-reduces their norm there (pytorch#148532). The
    norm's squares are summed over the host group instead: the global norm, every shard scaled."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp_path, "rank")
    mp.spawn(_offloaded_clip_rank, args=(port, out), nprocs=2)
    full = [torch.arange(12.0).reshape(6, 2), torch.linspace(-3, 3, 5)]
    expected = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in full])).item()
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for norm, _ in ranks:
        assert norm == pytest.approx(expected, rel=1e-6)
    for i, tensor in enumerate(full):
        clipped = torch.cat([grads[i] for _, grads in ranks])
        torch.testing.assert_close(clipped, tensor / (expected + 1e-6), rtol=1e-6, atol=0)

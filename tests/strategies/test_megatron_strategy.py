"""strategy="megatron" on CPU (megatron-core over gloo, Ray ranks): a GRPO step with tensor
parallelism 2, data parallelism 2 or pipeline stages (Qwen2; Qwen3 at TP=2 and PP=2) equals the
single-device step on the same batch; a fit syncs the engines exactly."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rltrainer import GRPO, Trainer, prompt_dataloader
from rltrainer.data.batch import RolloutBatch
from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import MegatronStrategy, SingleDeviceStrategy
from rltrainer.testing import FrozenEmbeddingGRPO, length_reward, prepared_batch
from rltrainer.weights.delta import DeltaSync

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core is not installed (dev extra: pip install -e '.[dev]')"),
              pytest.mark.usefixtures("warm_ranks")]  # ranks reuse warm processes (tests/conftest.py)


def make_module(config, tokenizer, cls=GRPO, **kwargs):
    # lr 1e-3: Adam divides by sqrt(v), which magnifies float-rounding differences between layouts in
    # near-zero gradients in proportion to lr (1e-2 gave up to 1.6e-5 after two steps)
    defaults = dict(reward_funcs=length_reward, num_generations=4, max_new_tokens=8, lr=1e-3, kl_coef=0.05)
    return cls(config, tokenizer, **{**defaults, **kwargs})


class LayoutGRPO(GRPO):
    """GRPO whose AdamW has ``eps=1e-6``: a gradient that cancels to ~0 keeps a float-rounding residue
    (~2e-9 here) that differs between layouts, and AdamW's first step moves its weight by
    lr * g / (|g| + eps), which at the default eps=1e-8 turns a few 1e-10 of difference into ~2e-5
    of weight (seen: o_proj[1, 33], gradient -2.1e-9 against a median of 1.6e-3; the single-device
    residue alone moved from -1.86e-9 to -2.1e-9 when its head began summing in blocks). At eps=1e-6
    a residue of up to 2e-9 moves a weight by at most lr * 2e-9 / 1e-6 = 2e-6, while every other
    gradient (|g| >> 1e-6) still takes Adam's full step, so the comparison tests the layouts, not the
    division of rounding noise."""

    def configure_optimizers(self):
        out = super().configure_optimizers()
        for group in out["optimizer"].param_groups:
            group["eps"] = 1e-6
        return out


@pytest.fixture
def config(bpe_tokenizer):
    from rltrainer.testing import tiny_qwen2_config

    return tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)


@pytest.mark.parametrize("devices,tp,pp,family,overlap", [
    (2, 2, 1, "qwen2", False), (2, 1, 1, "qwen2", False), (2, 1, 2, "qwen2", False), (4, 1, 2, "qwen2", False),
    (4, 2, 2, "qwen2", False), (4, 1, 2, "qwen2", True), (2, 2, 1, "qwen3", False), (2, 1, 2, "qwen3", False)],
    ids=["tp2", "dp2", "pp2", "dp2-pp2", "tp2-pp2", "dp2-pp2-overlap", "tp2-qwen3", "pp2-qwen3"])
def test_ranks_match_one_device(devices, tp, pp, family, overlap, config, bpe_tokenizer, gsm8k_prompts, ray_session):
    """Qwen3: q/k norms (replicated over TP, their gradients summed over it) and heads x head_dim
    (4 x 16) != hidden (32). ``overlap``: megatron's overlapped, bucketed gradient reduction."""
    if family == "qwen3":
        from rltrainer.testing import tiny_qwen3_config

        config = tiny_qwen3_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)
    prompts = RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(3)])  # prompts of unequal length
    single_module = make_module(config, bpe_tokenizer, cls=LayoutGRPO)
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=8)
    single.setup(single_module, seed=7)
    torch.manual_seed(0)
    batch = prepared_batch(single_module, single, prompts)
    strategy = MegatronStrategy(devices=devices, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                micro_batch_size=5, overlap_grad_reduce=overlap,
                                ddp_bucket_size=2048 if overlap else None)  # several buckets on the first stage
    try:
        strategy.setup(make_module(config, bpe_tokenizer, cls=LayoutGRPO), seed=7)
        before = dict(strategy.export_weights())
        for name, p in single_module.policy.named_parameters():
            assert torch.equal(before[name], p.detach()), name
        torch.testing.assert_close(strategy.compute(batch, "ref")["ref_log_probs"], batch["ref_log_probs"],
                                   rtol=0, atol=1e-5)
        for _ in range(2):
            m_single, m_meg = single.train_step(batch), strategy.train_step(batch)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert m_meg[key] == pytest.approx(m_single[key], rel=1e-4, abs=1e-6), key
        after = dict(strategy.export_weights())
        # LayoutGRPO's eps=1e-6 bounds what a ~0 gradient's rounding residue (up to ~2e-9) moves a
        # weight: 2e-6 a step, 4e-6 after two; seen at most 7.8e-7 (Qwen3), 2.8e-7 (Qwen2). At eps=1e-8
        # the same residues gave up to 5e-5 (Qwen3, PP=2)
        for name, p in single_module.policy.named_parameters():
            torch.testing.assert_close(after[name], p.detach(), rtol=0, atol=5e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
    finally:
        strategy.teardown()


DDP = "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel"


@pytest.mark.parametrize("distributed,overlap", [(True, True), (False, False)],
                         ids=["distributed-optimizer-overlap", "plain-optimizer"])
def test_dp2_lr_schedule_and_clipping_match_one_device(distributed, overlap, config, bpe_tokenizer, gsm8k_prompts,
                                                       ray_session):
    """megatron's DDP and optimizer step the policy as the user's AdamW does on one device: the
    warm-up schedule's lr each step, the gradient norm before clipping, and the parameters after
    three steps clipped to a norm far below the gradient's (so every step clips)."""
    prompts = RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(3)])
    single_module = make_module(config, bpe_tokenizer, warmup_steps=3)
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=8, gradient_clip_val=1e-3)
    single.setup(single_module, seed=7)
    torch.manual_seed(0)
    batch = prepared_batch(single_module, single, prompts)
    strategy = MegatronStrategy(devices=2, micro_batch_size=5, gradient_clip_val=1e-3,
                                use_distributed_optimizer=distributed, overlap_grad_reduce=overlap,
                                ddp_bucket_size=2048 if overlap else None)  # several buckets: several reductions
    try:
        strategy.setup(make_module(config, bpe_tokenizer, warmup_steps=3), seed=7)
        optimizer = ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer" if distributed
                     else "megatron.core.optimizer.optimizer.FP32Optimizer")
        for layout in strategy.require_group().execute_all("training_layout"):
            assert layout == {"ddp": {"policy": DDP}, "optimizers": [optimizer]}
        lrs = []
        for _ in range(3):
            m_single, m_meg = single.train_step(batch), strategy.train_step(batch)
            lrs.append(m_meg["actor/lr"])
            assert m_meg["actor/lr"] == pytest.approx(m_single["actor/lr"], rel=1e-12)
            assert m_meg["actor/grad_norm"] == pytest.approx(m_single["actor/grad_norm"], rel=1e-4)
            assert m_single["actor/grad_norm"] > 10 * 1e-3  # clipped
        assert lrs == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3], rel=1e-12)  # lr 1e-3, 3 warm-up steps from 0
        after = dict(strategy.export_weights())
        for name, p in single_module.policy.named_parameters():
            torch.testing.assert_close(after[name], p.detach(), rtol=0, atol=1e-5, msg=name)
    finally:
        strategy.teardown()


def test_dp2_bf16_steps_with_the_distributed_optimizer(config, bpe_tokenizer, gsm8k_prompts, ray_session):
    """bf16-true on megatron's DDP and distributed optimizer: two steps move every weight, and the
    gradient norm stays within bf16 rounding of the fp32 single-device one."""
    prompts = RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(3)])
    single_module = make_module(config, bpe_tokenizer)
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=8)
    single.setup(single_module, seed=7)
    torch.manual_seed(0)
    batch = prepared_batch(single_module, single, prompts)
    strategy = MegatronStrategy(devices=2, micro_batch_size=5, precision="bf16-true")
    try:
        strategy.setup(make_module(config, bpe_tokenizer), seed=7)
        assert strategy.require_group().execute_all("training_layout")[0]["optimizers"] == [
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"]
        before = dict(strategy.export_weights())
        for _ in range(2):
            m_single, m_meg = single.train_step(batch), strategy.train_step(batch)
            assert m_meg["actor/grad_norm"] == pytest.approx(m_single["actor/grad_norm"], rel=2e-2)
        after = dict(strategy.export_weights())
        assert all(not torch.equal(before[n], after[n]) for n in before)  # every weight moved
    finally:
        strategy.teardown()


def llama_config(vocab_size):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False, use_cache=False)


@pytest.mark.parametrize("tp,pp,arch,placement", [(2, 1, "qwen2", "colocated"), (1, 2, "qwen2", "colocated"),
                                                  (1, 2, "llama", "colocated"), (1, 2, "qwen2", "split"),
                                                  (1, 2, "qwen2", "split-delta")],
                         ids=["tp2-qwen2-tied", "pp2-qwen2-tied", "pp2-llama-untied", "pp2-split-broadcast",
                              "pp2-split-broadcast-delta"])
def test_fit_syncs_engines_exactly(tp, pp, arch, placement, config, bpe_tokenizer, gsm8k_prompts, ray_session):
    """A frozen embedding is skipped exactly; everything else reaches every engine bit-exactly in
    several buckets, from whichever pipeline stage holds it (split: broadcast from trainer rank 0;
    split-delta: with ``Rollout(delta=...)``, whose bf16 engine gets deltas after the first steps)."""
    delta = placement == "split-delta"
    placement = placement.removesuffix("-delta")
    if arch == "llama":
        config = llama_config(len(bpe_tokenizer))
    module = FrozenEmbeddingGRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8,
                                 lr=1e-5 if delta else 1e-3, kl_coef=0.05)  # delta: small steps leave most bf16 words
    strategy = MegatronStrategy(devices=2, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    engine = HFEngine(dtype=torch.bfloat16) if delta else None
    rollout = Rollout(engine or "hf", placement=placement, transport="broadcast", bucket_bytes=32 << 10,
                      delta=DeltaSync(max_share=0.5) if delta else False)
    with Trainer(strategy=strategy, rollout=rollout, max_steps=4 if delta else 2, logger=False,
                 enable_progress_bar=False, seed=1) as trainer:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
        m = trainer.callback_metrics
        assert m["sync/skipped"] == 1 and m["sync/tensors"] == len(strategy.weight_names()) - 1  # the embedding
        assert m["sync/buckets"] > 1
        assert ("lm_head.weight" in strategy.weight_names()) == (arch == "llama")
        if delta:
            assert m["sync/delta_buckets"] > 0 and m["sync/wire_share"] < 1 and m["sync/checksum_mismatches"] == 0
        full = {n: t.to(torch.bfloat16) if delta else t for n, t in strategy.export_weights()}
        engines = rollout.group if placement == "split" else strategy.group
        for replica in engines.execute_all("engine_weights"):
            for name, tensor in full.items():
                assert torch.equal(replica[name], tensor), name


def test_bad_megatron_arguments():
    with pytest.raises(ValueError, match="must divide"):
        MegatronStrategy(devices=2, pipeline_model_parallel_size=3)
    with pytest.raises(ValueError, match="must divide"):
        MegatronStrategy(devices=3, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size must be an int >= 1, got 0"):
        MegatronStrategy(devices=4, tensor_model_parallel_size=2, pipeline_model_parallel_size=0)
    with pytest.raises(ValueError, match="precision"):
        MegatronStrategy(precision="bf16-mixed")


def test_megatron_optimizer_translates_the_users_and_refuses_others():
    """configure_optimizers()'s torch optimizer becomes megatron-core's OptimizerConfig; what it
    cannot translate is refused, naming what it can."""
    from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

    from rltrainer.strategies.megatron.optimizer import optimizer_config

    params = [torch.nn.Parameter(torch.zeros(2))]
    options = {"use_distributed_optimizer": True, "gradient_clip_val": 0.5, "precision": "32-true"}
    adamw = torch.optim.AdamW(params, lr=3e-4, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    cfg = optimizer_config([adamw], options)
    assert (cfg.optimizer, cfg.lr, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.weight_decay) == (
        "adam", 3e-4, 0.8, 0.9, 1e-6, 0.1)
    assert cfg.decoupled_weight_decay and cfg.use_distributed_optimizer and cfg.clip_grad == 0.5
    assert optimizer_config([adamw], {**options, "gradient_clip_val": None}).clip_grad == 0.0  # no clipping
    assert not optimizer_config([torch.optim.Adam(params, weight_decay=0.1)],
                                {**options, "use_distributed_optimizer": False}).decoupled_weight_decay
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.5)
    assert optimizer_config([sgd], {**options, "use_distributed_optimizer": False}).optimizer == "sgd"
    with pytest.raises(ValueError, match="use_distributed_optimizer=False"):
        optimizer_config([sgd], options)
    with pytest.raises(TypeError, match="RMSprop.*torch.optim.AdamW"):
        optimizer_config([torch.optim.RMSprop(params)], options)
    with pytest.raises(ValueError, match="amsgrad=False"):
        optimizer_config([torch.optim.AdamW(params, amsgrad=True)], options)
    with pytest.raises(ValueError, match="all be Adam"):
        optimizer_config([adamw, sgd], {**options, "use_distributed_optimizer": False})
    if USING_PYTORCH_OPTIMIZER:  # no Transformer Engine / apex: torch's AdamW is the only Adam it shards
        with pytest.raises(ValueError, match="torch.optim.AdamW"):
            optimizer_config([torch.optim.Adam(params, weight_decay=0.1)], options)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])  # dp2: sharded optimizer
def test_megatron_checkpoint_resume_matches_uninterrupted_run(tp, pp, config, bpe_tokenizer, gsm8k_prompts, tmp_path,
                                                              ray_session):
    def run(max_steps, ckpt=None, save=None):
        module = make_module(config, bpe_tokenizer, num_generations=2, warmup_steps=2)  # the lr moves at resume
        strategy = MegatronStrategy(devices=2, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        with Trainer(strategy=strategy, max_steps=max_steps, logger=False, enable_progress_bar=False, seed=6,
                     default_root_dir=tmp_path) as trainer:
            trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2), ckpt_path=ckpt)
            if save:
                trainer.save_checkpoint(save)
            return dict(strategy.export_weights())

    full = run(2)
    run(1, save=tmp_path / "step1.ckpt")
    resumed = run(2, ckpt=tmp_path / "step1.ckpt")
    for name, tensor in full.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_ppo_critic_on_tensor_parallel_matches_one_device(config, bpe_tokenizer, gsm8k_prompts, ray_session):
    """PPO's critic (a token-classification model) runs as a megatron trunk + replicated head."""
    from rltrainer import PPO

    def ppo():
        return PPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=4, max_new_tokens=8, lr=1e-3,
                   critic_lr=1e-3, kl_coef=0.05)

    prompts = RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(2)])
    single_module = ppo()
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=8)
    single.setup(single_module, seed=3)
    torch.manual_seed(0)
    batch = prepared_batch(single_module, single, prompts)  # with "values" from the critic
    strategy = MegatronStrategy(devices=2, tensor_model_parallel_size=2, micro_batch_size=4)
    try:
        strategy.setup(ppo(), seed=3)
        for layout in strategy.require_group().execute_all("training_layout"):  # both models, one optimizer
            assert layout == {"ddp": {"policy": DDP, "critic": DDP},
                              "optimizers": ["megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"]}
        torch.testing.assert_close(strategy.compute(batch, "values")["values"], batch["values"], rtol=0, atol=1e-5)
        for _ in range(2):
            m_single, m_meg = single.train_step(batch), strategy.train_step(batch)
        assert m_meg["critic/vf_loss"] == pytest.approx(m_single["critic/vf_loss"], rel=1e-4, abs=1e-6)
        with torch.no_grad():  # the critics moved alike
            # after two AdamW steps a weight whose gradient is near 0 may differ by up to 2 * lr * d / eps
            # = 2 * 1e-3 * 6e-12 / 1e-8 = 1.2e-6 (see make_module); a value sums 32 such weights times
            # hidden states of size ~1 in the worst case: 32 * 1.2e-6 = 3.8e-5
            torch.testing.assert_close(strategy.compute(batch, "values")["values"],
                                       single.compute(batch, "values")["values"], rtol=0, atol=4e-5)
    finally:
        strategy.teardown()


def test_pipeline_stages_refuse_a_critic_in_the_policy_step(config, bpe_tokenizer, ray_session):
    from rltrainer import PPO
    from rltrainer.controller.worker_group import WorkerError

    module = PPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8)
    strategy = MegatronStrategy(devices=2, pipeline_model_parallel_size=2)
    try:
        with pytest.raises(WorkerError, match="pipeline_model_parallel_size=1"):
            strategy.setup(module, seed=0)
    finally:
        strategy.teardown()


class FailingGRPO(GRPO):
    def policy_step(self, micro_batch):
        loss, metrics = super().policy_step(micro_batch)  # on the first stage this ends at the model call
        raise ValueError("policy_step failed on the last stage")


def test_hook_error_on_last_stage_reaches_the_controller(config, bpe_tokenizer, gsm8k_prompts, ray_session):
    """The first stage waits for gradients the last never sends: the error must surface, not hang."""
    import time

    from rltrainer.controller.worker_group import WorkerError

    module = FailingGRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4)
    strategy = MegatronStrategy(devices=2, pipeline_model_parallel_size=2)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="policy_step failed on the last stage"):
        with Trainer(strategy=strategy, max_steps=1, logger=False, enable_progress_bar=False) as trainer:
            trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    assert time.monotonic() - start < 120

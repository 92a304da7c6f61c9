"""strategy="megatron" with a mixture of experts (Qwen3-MoE, Mixtral) on CPU: megatron-core's
MoE layer (router, all-to-all dispatcher, SequentialMLP experts) trains GRPO steps equal to the
single-device transformers step (``rltrainer.models.moe``), in process (EP=1) and over gloo with the
experts split over two ranks (EP=2, Ray ranks), replaying the ``hf`` engine's routes on both sides;
its routers fill the same ``moe/*`` metrics and load-balancing loss; the weights leave in the names
(and fused expert tensors) the transformers model has, and reach the ``hf`` engine bit-exactly.

The load-balancing loss is one forward's (transformers' ``load_balancing_loss_func`` over a
micro-batch), so it depends on how rows fall into micro-batches: the layout comparisons set
``router_aux_loss_coef=0``, and the loss is compared where both sides run one micro-batch.
Routing replay through megatron's router, token by token: megatron_moe_check.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rltrainer import GRPO, Trainer, prompt_dataloader
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import build_causal_lm
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import MegatronStrategy, SingleDeviceStrategy
from rltrainer.testing import length_reward, prepared_batch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed (dev extra: pip install -e '.[dev]')")

SCRIPT = Path(__file__).with_name("megatron_moe_check.py")


def tiny_qwen3_moe(vocab_size, **overrides):
    """8 experts of 32, top-2 renormalised (Qwen3-30B-A3B's ``norm_topk_prob=True``), q/k norms,
    ``heads x head_dim = 64 != hidden = 32``, untied."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{
        "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 1024,
        "tie_word_embeddings": False, "use_cache": False, **overrides})


def tiny_mixtral(vocab_size, **overrides):
    """4 experts of 32, top-2 (Mixtral always renormalises), tied embeddings."""
    from transformers import MixtralConfig

    return MixtralConfig(**{
        "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "max_position_embeddings": 1024, "tie_word_embeddings": True, "use_cache": False, **overrides})


CONFIGS = {"qwen3_moe": tiny_qwen3_moe, "mixtral": tiny_mixtral,
           "qwen3_moe-unnormalised": lambda v: tiny_qwen3_moe(v, norm_topk_prob=False)}
#: the moe/* count metrics, [L, E] or [L, 2], summed over micro-batches and ranks (the load-balancing
#: loss, moe/aux_loss, is one forward's)
COUNTED = ("moe/expert_tokens", "moe/router_entropy", "moe/routing_agreement")


class LayoutGRPO(GRPO):
    """AdamW at ``eps=1e-6`` (see test_megatron_strategy.py's ``LayoutGRPO``): a gradient that
    cancels to ~0 keeps a rounding residue that differs between layouts; at eps=1e-6 it moves a
    weight by at most lr * 2e-9 / 1e-6 per step."""

    def configure_optimizers(self):
        out = super().configure_optimizers()
        for group in out["optimizer"].param_groups:
            group["eps"] = 1e-6
        return out


def make_module(config, tokenizer, **kwargs):
    return LayoutGRPO(config, tokenizer, **{**dict(reward_funcs=length_reward, num_generations=4, max_new_tokens=8,
                                                   lr=1e-3, kl_coef=0.05, router_aux_loss_coef=0.0), **kwargs})


def compare_steps(family, devices, ep, bpe_tokenizer, gsm8k_prompts, micro_batch_size=5, single_micro_batch_size=8,
                  **module_kwargs):
    """Two GRPO steps on one batch (with the engine's routes): ``single`` and megatron (``devices``
    ranks, ``ep`` expert-parallel); returns their exports, initial and final, and both steps' metrics."""
    config = CONFIGS[family](len(bpe_tokenizer))
    prompts = RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(3)])  # prompts of unequal length
    single_module = make_module(config, bpe_tokenizer, **module_kwargs)
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=single_micro_batch_size)
    single.setup(single_module, seed=7)
    torch.manual_seed(0)
    batch = prepared_batch(single_module, single, prompts)
    assert batch["routed_experts"].shape[2:] == (config.num_hidden_layers, config.num_experts_per_tok)
    strategy = MegatronStrategy(devices=devices, expert_model_parallel_size=ep, micro_batch_size=micro_batch_size)
    try:
        strategy.setup(make_module(config, bpe_tokenizer, **module_kwargs), seed=7)
        before = dict(strategy.export_weights())
        ref = strategy.compute(batch, "ref")["ref_log_probs"]
        metrics = [(single.train_step(batch), strategy.train_step(batch)) for _ in range(2)]
        after = dict(strategy.export_weights())
        layout = strategy.require_group().execute_all("training_layout") if devices > 1 else None
    finally:
        strategy.teardown()
    return dict(single=single_module.policy, batch=batch, before=before, ref=ref, metrics=metrics, after=after,
                layout=layout)


def check_steps(out, atol, keys=("actor/pg_loss", "actor/kl_loss", "actor/grad_norm")):
    """The exports (names, every tensor moved, within ``atol``), the reference log-probs, ``keys``
    of both steps' metrics, and the routing counts (the experts' tokens and the agreement with the
    engine exactly, the routers' entropy sums within 1e-5 relative)."""
    single = dict(out["single"].named_parameters())
    assert list(out["before"]) == list(out["after"]) and set(out["before"]) == set(single)  # HF names, fused experts
    torch.testing.assert_close(out["ref"], out["batch"]["ref_log_probs"], rtol=0, atol=1e-5)
    for m_single, m_meg in out["metrics"]:
        for key in keys:
            assert m_meg[key] == pytest.approx(m_single[key], rel=1e-4, abs=1e-6), key
        for key in COUNTED:
            torch.testing.assert_close(m_meg[key], m_single[key], rtol=1e-5 if key == "moe/router_entropy" else 0,
                                       atol=0, msg=key)
    agreement = out["metrics"][1][0]["moe/routing_agreement"]  # [L, 2]: tokens whose router picks the engine's, of all
    assert (agreement[:, 0] < agreement[:, 1]).all()  # the second step replays routes its router no longer picks
    for name, p in single.items():
        assert not torch.equal(out["before"][name], out["after"][name]), name  # every tensor moved, router included
        torch.testing.assert_close(out["after"][name], p.detach(), rtol=0, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_in_process_moe_steps_match_one_device(family, bpe_tokenizer, gsm8k_prompts):
    """One in-process rank (EP=1): megatron's MoE layer with every expert local, replaying the
    engine's routes in the reference log-probs and the update; the routing metrics sum alike."""
    out = compare_steps(family, 1, 1, bpe_tokenizer, gsm8k_prompts)
    check_steps(out, atol=5e-6)


def test_load_balancing_loss_matches_one_device(bpe_tokenizer, gsm8k_prompts):
    """With ``router_aux_loss_coef=0.1`` (both sides one micro-batch of the 12 rows), megatron's
    routers give the Routing part the load-balancing loss transformers' give: the same
    ``moe/aux_loss``, and its gradient moves the weights alike."""
    out = compare_steps("qwen3_moe", 1, 1, bpe_tokenizer, gsm8k_prompts, micro_batch_size=16,
                        single_micro_batch_size=16, router_aux_loss_coef=0.1)
    assert out["metrics"][0][0]["moe/aux_loss"] > 0.1
    check_steps(out, atol=5e-6, keys=("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "moe/aux_loss"))


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_parallel_steps_match_one_device(family, bpe_tokenizer, gsm8k_prompts, ray_session):
    """Two ranks, EP=2: each holds half of every layer's experts, tokens go to them and back by
    megatron-core's all-to-all over gloo, everything else is data parallel; the experts step in an
    optimizer of their own (megatron's expert-data-parallel group). The GRPO steps replaying the
    engine's routes, the reference log-probs, the routing metrics (summed over the ranks) and the
    weights after two steps equal the single-device ones."""
    out = compare_steps(family, 2, 2, bpe_tokenizer, gsm8k_prompts)
    distributed = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
    for layout in out["layout"]:  # dense parameters, then experts (their expert-data-parallel group)
        assert layout["optimizers"] == [distributed, distributed]
    check_steps(out, atol=5e-6)


@pytest.mark.parametrize("devices,ep,family", [(1, 1, "qwen3_moe"), (2, 2, "mixtral")], ids=["in-process", "ep2"])
def test_moe_fit_syncs_hf_engine_exactly(devices, ep, family, bpe_tokenizer, gsm8k_prompts, request):
    """A fit (GRPO's defaults: the engine records routes, the update replays them, the config's
    load-balancing loss) reports the routing metrics from megatron's routers and syncs every tensor,
    in the transformers model's own names (the fused experts), into the ``hf`` engine bit-exactly,
    in several buckets."""
    if devices > 1:
        request.getfixturevalue("ray_session")
        request.getfixturevalue("warm_ranks")
    config = CONFIGS[family](len(bpe_tokenizer))
    module = GRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8, lr=1e-3,
                  kl_coef=0.05)
    strategy = MegatronStrategy(devices=devices, expert_model_parallel_size=ep)
    with Trainer(strategy=strategy, rollout=Rollout(bucket_bytes=32 << 10), max_steps=2, logger=False,
                 enable_progress_bar=False, seed=5) as trainer:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
        m = trainer.callback_metrics
        assert m["sync/buckets"] > 1
        assert m["moe/aux_loss"] > 0 and 0 < m["moe/routing_agreement"] <= 1 and m["moe/expert_share/max"] > 0
        full = dict(strategy.export_weights())
        assert set(full) == {n for n, _ in build_causal_lm(config, seed=0).named_parameters()}  # fused experts, gate
        for replica in strategy.group.execute_all("engine_weights"):
            assert replica.keys() >= full.keys()
            for name, tensor in full.items():
                assert torch.equal(replica[name], tensor), name


def test_moe_replay_through_megatrons_router_on_two_expert_ranks():
    """Routing replay (megatron_moe_check.py, two gloo ranks, EP=2): with given routes, megatron's
    routers select exactly those experts (one route set differs from the router's own choice in
    every token; -1 rows fall back to it), the response log-probs and entropies equal transformers'
    replayed forward, the router weights still get gradients and every gradient equals
    transformers'. Without routes, megatron routes as transformers does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "qwen3_moe", "mixtral"], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r["check"]: r for r in map(json.loads, (line for line in proc.stdout.splitlines()
                                                       if line.startswith('{"check"')))}
    assert sorted(results) == ["mixtral", "qwen3_moe"]
    for check, r in results.items():
        assert r["own_routes_equal"] and r["replayed_routes_equal"] and r["fallback_routes_equal"], check
        assert r["replay_differs_from_own"] == 1.0, check  # every token's given experts differ from the router's
        assert r["log_probs_max_abs_diff"] < 1e-5 and r["no_replay_max_abs_diff"] < 1e-5, check
        assert r["replay_moved_log_probs"] > 1e-2, check  # the replay changed the function
        assert min(r["router_grad_norms"]) > 0 and r["grad_names"], check
        assert r["grad_max_rel_diff"] < 1e-5, check  # of each tensor's largest gradient (~1-10 here)


@pytest.mark.parametrize("family,options,error", [
    ("qwen3_moe", {"tensor_model_parallel_size": 2}, r"tensor_model_parallel_size=2 with a mixture of experts.*"
                                                      r"sequence parallelism"),
    ("dense", {"expert_model_parallel_size": 2}, r"expert_model_parallel_size=2 .* dense qwen3 model"),
    ("mixtral", {"expert_model_parallel_size": 3}, r"expert_model_parallel_size=3 must divide the policy's 4 experts"),
    ("qwen3_moe", {"moe_grouped_gemm": True}, r"moe_grouped_gemm=True .*TEGroupedMLP.*this rank runs on cpu"),
    ("mixtral", {"pipeline_model_parallel_size": 2}, r"pipeline_model_parallel_size=2 with a mixture-of-experts "
                                                     r"policy .*load_balancing_loss_func"),
], ids=["tp2", "dense-ep2", "ep3", "grouped-gemm-on-cpu", "pp2"])
def test_what_megatron_does_not_run_with_experts_is_refused_at_setup(family, options, error, bpe_tokenizer):
    """Each rank refuses right after ``configure_model``, before megatron-core starts (rank 0 of 2
    here, with no process group: any collective would fail)."""
    from rltrainer.strategies.megatron import MegatronWorker
    from rltrainer.testing import tiny_qwen3_config

    config = (tiny_qwen3_config(len(bpe_tokenizer), hidden_size=32) if family == "dense"
              else CONFIGS[family](len(bpe_tokenizer)))
    module = make_module(config, bpe_tokenizer)
    worker = MegatronWorker(rank=0, world_size=2, device="cpu")
    options = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "precision": "32-true", **options}
    with pytest.raises((ValueError, NotImplementedError), match=error):
        worker.setup(module, options, seed=0)


def test_expert_parallel_size_must_divide_the_data_parallel_ranks():
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=4 must divide the data-parallel size, 2"):
        MegatronStrategy(devices=4, pipeline_model_parallel_size=2, expert_model_parallel_size=4)


def test_moe_checkpoint_saved_at_ep2_resumes_at_ep1(bpe_tokenizer, gsm8k_prompts, tmp_path, ray_session, warm_ranks):
    """A checkpoint holds the fused HF expert tensors (weights and Adam's moments, gathered over the
    expert-parallel ranks, each expert's moments over its expert-data-parallel group): saved at EP=2,
    resumed at EP=1 (the same two ranks, every expert's optimizer state now split over the two
    data-parallel ranks), the next step equals the EP=2 run's, and so do the
    weights and moments it saves (weights within 1e-5, moments within 1e-3 of their norm, as in
    test_megatron_checkpoint.py)."""
    from rltrainer import ModelCheckpoint
    from rltrainer.callbacks import Callback
    from rltrainer.models import SafetensorsWeights

    class Metrics(Callback):
        def __init__(self) -> None:
            self.steps = {}

        def on_step_end(self, trainer, module, metrics):
            self.steps[trainer.global_step] = dict(metrics)

    def saved(path):
        files = SafetensorsWeights(str(path / "training"))
        return {name: files.read(name) for name in files.names()}

    config = CONFIGS["qwen3_moe"](len(bpe_tokenizer))

    def run(root, devices, ep, max_steps, ckpt=None):
        module = GRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=4, max_new_tokens=8,
                      lr=1e-3, kl_coef=0.05)
        metrics = Metrics()
        with Trainer(strategy=MegatronStrategy(devices=devices, expert_model_parallel_size=ep), max_steps=max_steps,
                     logger=False, enable_progress_bar=False, seed=6, default_root_dir=root,
                     callbacks=[metrics, ModelCheckpoint(dirpath=root, every_n_steps=1, keep=5)]) as trainer:
            trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2), ckpt_path=ckpt)
        return metrics.steps

    full = run(tmp_path / "ep2", 2, 2, max_steps=2)
    step1 = saved(tmp_path / "ep2" / "step=1.ckpt")
    assert step1["policy/weight/model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 32)
    assert "policy/exp_avg_sq/model.layers.1.mlp.experts.down_proj" in step1
    resumed = run(tmp_path / "ep1", 2, 1, max_steps=2, ckpt=tmp_path / "ep2" / "step=1.ckpt")
    assert list(resumed) == [2]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr"):
        assert resumed[2][key] == pytest.approx(full[2][key], rel=1e-4, abs=1e-6), key
    got, want = saved(tmp_path / "ep1" / "step=2.ckpt"), saved(tmp_path / "ep2" / "step=2.ckpt")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        if "/weight/" in name:
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)
        else:
            assert (got[name] - tensor).norm() / tensor.norm().clamp_min(1e-30) < 1e-3, name


@pytest.mark.usefixtures("warm_ranks")
def test_random_routes_reach_megatrons_routers_through_the_strategy(bpe_tokenizer, gsm8k_prompts, ray_session):
    """Routes unlike the router's own choice (random experts per token and layer; -1 on padding and
    in one row's response), as a batch field: they travel with their rows into each EP=2 rank's
    micro-batches and megatron's schedule, and the reference log-probs replaying them equal the
    single-device transformers ones replaying them (``rltrainer.models.moe``), far from the
    unreplayed ones."""
    config = CONFIGS["qwen3_moe"](len(bpe_tokenizer))
    prompts = RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(3)])
    single_module = make_module(config, bpe_tokenizer)
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=8)
    single.setup(single_module, seed=7)
    torch.manual_seed(0)
    batch = prepared_batch(single_module, single, prompts)  # ref log-probs replaying the engine's routes
    n, columns = batch["input_ids"].shape
    generator = torch.Generator().manual_seed(3)
    routes = torch.stack([torch.randperm(config.num_experts, generator=generator)[:2]
                          for _ in range(n * columns * config.num_hidden_layers)])
    routes = routes.view(n, columns, config.num_hidden_layers, 2).to(torch.int16)
    routes[~batch["attention_mask"].bool()] = -1
    routes[1, -4:] = -1  # the router's own choice
    batch["routed_experts"] = routes
    want = single.compute(batch, "ref")["ref_log_probs"]
    strategy = MegatronStrategy(devices=2, expert_model_parallel_size=2, micro_batch_size=2)  # 3 micro-batches a rank
    try:
        strategy.setup(make_module(config, bpe_tokenizer), seed=7)
        got = strategy.compute(batch, "ref")["ref_log_probs"]
    finally:
        strategy.teardown()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - batch["ref_log_probs"]).abs().max() > 1e-2  # unlike the engine's routes

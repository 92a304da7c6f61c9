"""LoRA (rltrainer.lora): GRPO(lora=peft.LoraConfig(...)) trains only the adapter, on single and on
FSDP2 with 2 ranks (the same run); the reference is the base (adapter disabled, no copy); the hf
engine receives only the adapter after the first sync, an engine that loads no adapters the merged
weights; export writes the merged model or the adapter alone."""

from __future__ import annotations

import pytest
import torch

from rltrainer import GRPO, RolloutBatch, Trainer, prompt_dataloader
from rltrainer.models import build_causal_lm, response_log_probs
from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy
from rltrainer.testing import length_reward

peft = pytest.importorskip("peft")
TARGETS = ["q_proj", "v_proj", "gate_proj"]


def lora_config(**kwargs):
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **kwargs})


def make_module(config, tokenizer, **kwargs):
    defaults = dict(reward_funcs=length_reward, num_generations=2, max_new_tokens=8, lr=1e-2, kl_coef=0.05,
                    lora=lora_config())
    return GRPO(config, tokenizer, **{**defaults, **kwargs})


class MergedHFEngine(HFEngine):
    """The hf engine as an engine that loads no adapters (vLLM/SGLang without LoRA enabled)."""

    loads_adapters = False


def engine_param(params, name):
    """The hf engine's parameter (adapter injected) that the synced ``name`` loaded into."""
    hf = name.removeprefix("base_model.model.").replace(".lora_A.", ".lora_A.default.").replace(".lora_B.",
                                                                                             ".lora_B.default.")
    owner, _, leaf = hf.rpartition(".")
    return params[hf] if hf in params else params[f"{owner}.base_layer.{leaf}"]


def adapter_count(config):
    return 2 * len(TARGETS) * config.num_hidden_layers


def test_single_trains_the_adapter_alone_and_syncs_only_it(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path):
    from transformers import AutoModelForCausalLM

    module = make_module(tiny_config, bpe_tokenizer)
    with Trainer(strategy="single", max_steps=2, logger=False, enable_progress_bar=False, seed=3) as trainer:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
        assert module.ref_policy is None  # the base with the adapter disabled is the reference
        trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_" in n for n in trainable)
        m = trainer.callback_metrics
        assert m["sync/tensors"] == adapter_count(tiny_config) and m["actor/kl_loss"] > 0
        assert m["sync/bytes"] == sum(p.numel() * 4 for n, p in module.policy.named_parameters() if ".lora_" in n)

        batch = module.rollout_step(RolloutBatch.from_loader(gsm8k_prompts[:2]), trainer.engine)
        ref = trainer.strategy.compute(batch, "ref")["ref_log_probs"]
        base = build_causal_lm(tiny_config, seed=0).eval()  # GRPO's model_seed: the untouched base
        with torch.no_grad():
            torch.testing.assert_close(ref, response_log_probs(base, batch)[0], rtol=0, atol=1e-6)
            engine = trainer.engine.model
            ids = batch["input_ids"]
            torch.testing.assert_close(engine(input_ids=ids).logits, module.policy(input_ids=ids).logits,
                                       rtol=0, atol=0)  # base + adapter synced bit-exactly

        merged, adapter = trainer.save_hf(tmp_path / "merged"), trainer.save_hf(tmp_path / "adapter", lora="adapter")
        assert (adapter / "adapter_config.json").exists() and not (adapter / "model.safetensors").exists()
        with torch.no_grad():
            want = module.policy(input_ids=ids).logits
            got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            with_adapter = peft.PeftModel.from_pretrained(build_causal_lm(tiny_config, seed=0), adapter).eval()
            torch.testing.assert_close(with_adapter(input_ids=ids).logits, want, rtol=0, atol=1e-6)


def test_an_engine_without_adapters_gets_merged_weights(tiny_config, bpe_tokenizer, gsm8k_prompts):
    module = make_module(tiny_config, bpe_tokenizer)
    with Trainer(strategy="single", rollout=MergedHFEngine(), max_steps=2, logger=False, enable_progress_bar=False,
                 seed=3) as trainer:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
        assert trainer.callback_metrics["sync/tensors"] == len(TARGETS) * tiny_config.num_hidden_layers  # adapted only
        engine = dict(trainer.engine.model.named_parameters())
        assert not any(".lora_" in n for n in engine)
        ids = torch.tensor([gsm8k_prompts[0]["prompt_ids"]])
        with torch.no_grad():
            torch.testing.assert_close(trainer.engine.model(input_ids=ids).logits, module.policy(input_ids=ids).logits,
                                       rtol=0, atol=1e-5)


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
def test_fsdp2_two_ranks_match_single(tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    """The same adapter init on every rank, the base as reference, two steps on one batch equal to
    single's (lr 1e-6: Adam moves a weight at most ~lr a step, so rounding cannot push them apart
    beyond the tolerance), and the colocated engines hold base + adapter exactly, synced adapter-only."""
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.strategies import SingleDeviceStrategy
    from rltrainer.testing import prepared_batch

    prompts = RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(3)])
    single_module = make_module(tiny_config, bpe_tokenizer, lr=1e-6)
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=8)
    single.setup(single_module, seed=7)
    torch.manual_seed(0)
    batch = prepared_batch(single_module, single, prompts)
    fsdp = FSDP2Strategy(devices=2, micro_batch_size=5)
    try:
        fsdp.setup(make_module(tiny_config, bpe_tokenizer, lr=1e-6), seed=7)
        sync = Rollout(HFEngine(), bucket_bytes=16 << 10).connect(fsdp, bpe_tokenizer)
        assert sync.push(0, mode="wait")["sync/tensors"] == len(fsdp.weight_names())  # base once, then adapters
        before = dict(fsdp.export_weights())
        want = dict(single.export_weights())
        assert before.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(before[name], tensor), name  # same seed, same base and adapter on every rank
        torch.testing.assert_close(fsdp.compute(batch, "ref")["ref_log_probs"], batch["ref_log_probs"],
                                   rtol=0, atol=1e-5)
        for _ in range(2):
            m_single, m_fsdp = single.train_step(batch), fsdp.train_step(batch)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert m_fsdp[key] == pytest.approx(m_single[key], rel=1e-4, abs=1e-6), key
        stats = sync.push(1, mode="wait")
        assert stats["sync/tensors"] == adapter_count(tiny_config) and stats["sync/buckets"] >= 1
        after, want = dict(fsdp.export_weights()), dict(single.export_weights())
        for name, tensor in want.items():
            torch.testing.assert_close(after[name], tensor, rtol=0, atol=1e-5, msg=name)
        lora_b = next(n for n in after if ".lora_B." in n)
        assert not torch.equal(after[lora_b], before[lora_b])  # the adapter moved
        for replica in fsdp.group.execute_all("engine_weights"):
            for name, tensor in after.items():
                assert torch.equal(engine_param(replica, name), tensor), name
        with fsdp_merged(fsdp):
            merged = dict(fsdp.export_weights())
        assert not any(".lora_" in n for n in merged)
        assert len(merged) == len(list(single_module.policy.parameters())) - adapter_count(tiny_config)
    finally:
        fsdp.teardown()


def fsdp_merged(strategy):
    from rltrainer.lora import lora_view

    return lora_view(strategy, "merged")


def test_unsupported_lora_settings_are_refused(tiny_config, bpe_tokenizer):
    with pytest.raises(ValueError, match="use_dora"):
        make_module(tiny_config, bpe_tokenizer, lora=lora_config(use_dora=True))
    with pytest.raises(TypeError, match="peft.LoraConfig"):
        make_module(tiny_config, bpe_tokenizer, lora={"r": 4})
    module = make_module(tiny_config, bpe_tokenizer, lora=None)
    with Trainer(strategy="single", max_steps=1, logger=False, enable_progress_bar=False) as trainer:
        trainer._setup(module)
        with pytest.raises(ValueError, match="no LoRA adapter"):
            trainer.save_hf("unused", lora="adapter")

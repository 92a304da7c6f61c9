"""FSDP2 builds models on the meta device and each rank loads only its rows: from a checkpoint's
safetensors files, or (random init) from rank 0. Loaded weights equal a plain from_pretrained."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rltrainer import GRPO
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import RandomInit, SafetensorsWeights, build_causal_lm, deferred_init, frozen_copy, take_weight_source
from rltrainer.strategies import FSDP2Strategy, SingleDeviceStrategy
from rltrainer.testing import length_reward, prepared_batch


def make_module(model, tokenizer, **kwargs):
    defaults = {"reward_funcs": length_reward, "num_generations": 4, "max_new_tokens": 8, "kl_coef": 0.05}
    return GRPO(model, tokenizer, **{**defaults, **kwargs})


@pytest.fixture
def checkpoint(tiny_config, tmp_path):
    """A tiny random-init model saved as safetensors, in several files (tied LM head: not stored)."""
    path = tmp_path / "tiny"
    build_causal_lm(tiny_config, seed=11).save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").exists()
    return path


def test_deferred_build_is_meta_and_keeps_the_random_init(tiny_config):
    with deferred_init(init_random_here=False):
        model = build_causal_lm(tiny_config, seed=3)
        ref = frozen_copy(model)
    assert all(p.is_meta for p in model.parameters()) and all(p.is_meta for p in ref.parameters())
    assert not any(b.is_meta for b in model.buffers())  # RoPE frequencies are computed, not loaded
    source = take_weight_source(model)
    assert isinstance(source, RandomInit) and source.state is None and take_weight_source(ref) is source

    with deferred_init(init_random_here=True):
        model = build_causal_lm(tiny_config, seed=3)
        after_build = torch.get_rng_state()
    state = take_weight_source(model).state
    plain = build_causal_lm(tiny_config, seed=3)
    assert torch.equal(torch.get_rng_state(), after_build)  # the same draws as a plain build
    for name, p in plain.named_parameters():
        assert torch.equal(state[name], p.detach()), name


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
def test_two_ranks_read_only_their_rows_and_equal_from_pretrained(checkpoint, bpe_tokenizer, gsm8k_prompts,
                                                                  ray_session):
    plain = AutoModelForCausalLM.from_pretrained(checkpoint)
    single_module = make_module(str(checkpoint), bpe_tokenizer)
    single = SingleDeviceStrategy(device="cpu")
    single.setup(single_module, seed=5)  # a plain from_pretrained, policy and reference
    batch = prepared_batch(single_module, single, RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(2)]))

    fsdp = FSDP2Strategy(devices=2, micro_batch_size=4)
    try:
        fsdp.setup(make_module(str(checkpoint), bpe_tokenizer), seed=5)
        loaded = dict(fsdp.export_weights())
        for name, p in plain.named_parameters():
            assert loaded[name].dtype == p.dtype and torch.equal(loaded[name], p.detach()), name
        torch.testing.assert_close(fsdp.compute(batch, "ref")["ref_log_probs"], batch["ref_log_probs"], rtol=0,
                                   atol=1e-5)
        reports = fsdp.group.execute_all("load_report")
        for model in ("policy", "ref_policy"):
            full = reports[0][model]["full_bytes"]
            assert sum(r[model]["shard_bytes"] for r in reports) == full
            for r in reports:  # no rank read more than its own rows
                assert r[model]["source"] == f"safetensors files in {checkpoint}"
                assert r[model]["loaded_bytes"] == r[model]["shard_bytes"] < 0.6 * full
    finally:
        fsdp.teardown()


def test_one_rank_bf16_matches_from_pretrained_cast(checkpoint, bpe_tokenizer):
    fsdp = FSDP2Strategy(devices=1, precision="bf16-true")
    try:
        fsdp.setup(make_module(str(checkpoint), bpe_tokenizer, kl_coef=0.0), seed=0)
        loaded = dict(fsdp.export_weights())
    finally:
        fsdp.teardown()
    for name, p in AutoModelForCausalLM.from_pretrained(checkpoint).to(torch.bfloat16).named_parameters():
        assert torch.equal(loaded[name], p.detach()), name


def _setup_error(model, tokenizer):
    fsdp = FSDP2Strategy(devices=1)
    try:
        fsdp.setup(make_module(model, tokenizer), seed=0)
    finally:
        fsdp.teardown()


def test_bad_checkpoints_say_what_is_wrong(checkpoint, tiny_config, bpe_tokenizer, tmp_path):
    no_weights = tmp_path / "bin_only"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((checkpoint / "config.json").read_text())
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"bin_only holds no \*\.safetensors file \(it has: config\.json, "
                                                r"pytorch_model\.bin\)"):
        _setup_error(str(no_weights), bpe_tokenizer)
    with pytest.raises(FileNotFoundError, match="'./no/such/dir' is not a directory"):
        _setup_error("./no/such/dir", bpe_tokenizer)

    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"Cannot load policy: .*tiny: tensor 'model.layers.0.mlp.gate_proj.weight' has "
                                         r"shape \[128, 32\], but the model built from its config has \[96, 32\]"):
        _setup_error(str(checkpoint), bpe_tokenizer)


def test_safetensors_weights_read_only_the_rows_asked(checkpoint):
    weights = SafetensorsWeights(str(checkpoint))
    name = "model.embed_tokens.weight"
    rows = weights.read(name, 3, 7)
    full = AutoModelForCausalLM.from_pretrained(checkpoint).get_parameter(name).detach()
    assert torch.equal(rows, full[3:7]) and weights.bytes_read == rows.numel() * rows.element_size()
    with pytest.raises(KeyError, match="has no tensor 'lm_head.weight'"):
        weights.find(["lm_head.weight"])


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
def test_ppo_critic_from_a_config_is_deferred_too(tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    """PPO's critic (a token-classification model) from a config is built on meta and scattered from
    rank 0 like the policy: its values equal the single-device critic's with the same seed."""
    from rltrainer import PPO

    def ppo():
        return PPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8)

    single_module = ppo()
    single = SingleDeviceStrategy(device="cpu")
    single.setup(single_module, seed=3)
    batch = prepared_batch(single_module, single, RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(2)]))
    fsdp = FSDP2Strategy(devices=2)
    try:
        fsdp.setup(ppo(), seed=3)
        torch.testing.assert_close(fsdp.compute(batch, "values")["values"], batch["values"], rtol=0, atol=1e-5)
        reports = fsdp.group.execute_all("load_report")
    finally:
        fsdp.teardown()
    assert [r["critic"]["source"] for r in reports] == ["random init on rank 0"] * 2

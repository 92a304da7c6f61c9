"""strategy="megatron" builds models on the meta device: each rank reads from a checkpoint's
safetensors files only its pipeline stage's tensors and its tensor-parallel rows, or (random init)
receives its shard from rank 0. Loaded weights equal a plain from_pretrained; a random init equals
the one every rank used to run in full, RNG state included."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rltrainer import GRPO
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import build_causal_lm, frozen_copy
from rltrainer.strategies import MegatronStrategy, SingleDeviceStrategy
from rltrainer.testing import length_reward, prepared_batch

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core is not installed (dev extra: pip install -e '.[dev]')"),
              pytest.mark.usefixtures("warm_ranks")]  # ranks reuse warm processes (tests/conftest.py)


def make_module(model, tokenizer, cls=GRPO, **kwargs):
    defaults = {"reward_funcs": length_reward, "num_generations": 4, "max_new_tokens": 8, "kl_coef": 0.05}
    return cls(model, tokenizer, **{**defaults, **kwargs})


class BuiltInFullGRPO(GRPO):
    """configure_model builds the policy in full on every rank (what every rank did before)."""

    def configure_model(self) -> None:
        torch.manual_seed(self.model_seed)  # build_causal_lm's draws for a config, without deferral
        self.policy = AutoModelForCausalLM.from_config(self.model_spec)
        self.ref_policy = frozen_copy(self.policy)


@pytest.fixture
def checkpoint(tiny_config, tmp_path):
    """A tiny random-init model saved as safetensors, in several files (tied LM head: not stored)."""
    path = tmp_path / "tiny"
    build_causal_lm(tiny_config, seed=11).save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


def column_bytes_not_held(model, tp: int, pp: int) -> int:
    """Per rank: the other ranks' columns of its stage's o_proj and down_proj (read whole)."""
    columns = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if n.endswith(("o_proj.weight", "down_proj.weight")))
    return columns // pp * (tp - 1) // tp


def test_tp2_pp2_ranks_read_only_their_shard_and_equal_from_pretrained(checkpoint, bpe_tokenizer, gsm8k_prompts,
                                                                       ray_session):
    plain = AutoModelForCausalLM.from_pretrained(checkpoint)
    single_module = make_module(str(checkpoint), bpe_tokenizer)
    single = SingleDeviceStrategy(device="cpu")
    single.setup(single_module, seed=5)  # a plain from_pretrained, policy and reference
    batch = prepared_batch(single_module, single, RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(2)]))

    strategy = MegatronStrategy(devices=4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                micro_batch_size=4)
    try:
        strategy.setup(make_module(str(checkpoint), bpe_tokenizer), seed=5)
        loaded = dict(strategy.export_weights())
        assert loaded.keys() == dict(plain.named_parameters()).keys()
        for name, p in plain.named_parameters():
            assert loaded[name].dtype == p.dtype and torch.equal(loaded[name], p.detach()), name
        torch.testing.assert_close(strategy.compute(batch, "ref")["ref_log_probs"], batch["ref_log_probs"], rtol=0,
                                   atol=1e-5)  # the reference model was loaded too
        reports = strategy.group.execute_all("load_report")
    finally:
        strategy.teardown()
    extra = column_bytes_not_held(plain, tp=2, pp=2)
    nbytes = {n: p.numel() * p.element_size() for n, p in plain.named_parameters()}
    copies = nbytes["model.embed_tokens.weight"] + sum(b for n, b in nbytes.items() if n.endswith("norm.weight"))
    for model in ("policy", "ref_policy"):
        full = reports[0][model]["full_bytes"]
        assert full == sum(nbytes.values())
        # the shards split the model; the last stage holds its copy of the tied embedding, and both
        # tensor-parallel ranks hold the norms
        assert sum(r[model]["shard_bytes"] for r in reports) == full + copies
        for rank, r in enumerate(reports):  # each rank read its shard, plus the columns it reads whole
            assert r[model]["source"] == f"safetensors files in {checkpoint}", (rank, model)
            assert r[model]["loaded_bytes"] == r[model]["shard_bytes"] + extra, (rank, model)
            assert r[model]["loaded_bytes"] < 0.5 * full, (rank, model, r[model]["loaded_bytes"] / full)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_random_init_from_rank_zero_equals_every_rank_building_it(tp, pp, tiny_config, bpe_tokenizer, ray_session):
    """A config is initialised on rank 0 alone and each rank receives its shard: the weights and
    every rank's RNG state afterwards are those of building the model in full on every rank."""
    def setup(cls):
        strategy = MegatronStrategy(devices=2, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        try:
            strategy.setup(make_module(tiny_config, bpe_tokenizer, cls=cls), seed=3)
            return (dict(strategy.export_weights()), strategy.group.execute_all("rng_state"),
                    strategy.group.execute_all("load_report"))
        finally:
            strategy.teardown()

    deferred, deferred_rng, reports = setup(GRPO)
    full, full_rng, full_reports = setup(BuiltInFullGRPO)
    for name, tensor in full.items():
        assert torch.equal(deferred[name], tensor), name
    for rank, (a, b) in enumerate(zip(deferred_rng, full_rng)):
        assert torch.equal(a["torch"], b["torch"]), f"rank {rank}'s RNG state differs"
    assert full_reports[1]["policy"]["source"] == "built in full"
    for model in ("policy", "ref_policy"):
        assert [r[model]["source"] for r in reports] == ["random init on rank 0"] * 2
        assert reports[1][model]["loaded_bytes"] == reports[1][model]["shard_bytes"]  # received: its shard only


def test_ppo_critic_from_a_config_is_deferred_and_received(tiny_config, bpe_tokenizer, ray_session):
    """PPO's critic (a token-classification model) is built on meta too; rank 1 receives its trunk
    shard and the replicated norm and score head from rank 0."""
    from rltrainer import PPO

    strategy = MegatronStrategy(devices=2, tensor_model_parallel_size=2)
    try:
        strategy.setup(PPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2), seed=3)
        reports = strategy.group.execute_all("load_report")
    finally:
        strategy.teardown()
    critic = reports[1]["critic"]
    assert critic["source"] == "random init on rank 0" and critic["loaded_bytes"] == critic["shard_bytes"]
    assert critic["shard_bytes"] < 0.6 * critic["full_bytes"]


def _setup_error(model, tokenizer, **kwargs):
    from rltrainer.controller.worker_group import WorkerError

    strategy = MegatronStrategy(devices=2, **kwargs)
    try:
        with pytest.raises(WorkerError) as error:
            strategy.setup(make_module(model, tokenizer), seed=0)
        return str(error.value)
    finally:
        strategy.teardown()


def test_bad_checkpoint_raises_naming_the_tensor(checkpoint, bpe_tokenizer, ray_session):
    from safetensors.torch import load_file, save_file

    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    message = _setup_error(str(checkpoint), bpe_tokenizer, tensor_model_parallel_size=2)
    assert ("Cannot load policy: " in message and "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128, 32], "
            "but the model built from its config has [96, 32]" in message), message

    (checkpoint / "config.json").write_text(json.dumps(config))
    name = "model.layers.1.self_attn.o_proj.weight"  # a tensor of the last stage only
    file = next(f for f in checkpoint.glob("*.safetensors") if name in load_file(f))
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    message = _setup_error(str(checkpoint), bpe_tokenizer, pipeline_model_parallel_size=2)
    assert f"Cannot load policy: {checkpoint} has no tensor '{name}'" in message, message

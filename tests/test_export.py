"""Hugging Face export (rltrainer.export): ``Trainer.save_hf`` from single, FSDP2 (2 ranks, sharded)
and megatron (TP=2, PP=2) writes a directory ``AutoModelForCausalLM.from_pretrained`` loads, whose
log-probs equal the trained policy's own forward on the training ranks; the command converts a
saved checkpoint to the same tensors."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from rltrainer import GRPO, RolloutBatch, Trainer, prompt_dataloader
from rltrainer.export import main, write_safetensors
from rltrainer.models import response_log_probs
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy
from rltrainer.testing import length_reward

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed (dev extra: pip install -e '.[dev]')")


def make_module(config, tokenizer, **kwargs):
    defaults = dict(reward_funcs=length_reward, num_generations=2, max_new_tokens=8, lr=1e-2, kl_coef=0.05)
    return GRPO(config, tokenizer, **{**defaults, **kwargs})


def trained(strategy, config, tokenizer, prompts, steps=2, rollout="hf", **kwargs):
    trainer = Trainer(strategy=strategy, rollout=rollout, max_steps=steps, logger=False, enable_progress_bar=False,
                      seed=3)
    module = make_module(config, tokenizer, **kwargs)
    trainer.fit(module, prompt_dataloader(prompts, batch_size=2))
    return trainer, module


def policy_and_export_log_probs(trainer, module, path, prompts):
    """The trained policy's log-probs on a fresh rollout (its forward on the training ranks) and the
    exported model's on the same rows."""
    from transformers import AutoModelForCausalLM

    batch = module.rollout_step(RolloutBatch.from_loader(prompts[:2]), trainer.engine)
    trained_lp = trainer.strategy.compute(batch, "old_log_prob")["old_log_probs"]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        exported_lp = response_log_probs(model, batch)[0]
    return trained_lp, exported_lp, batch["response_mask"].bool()


def check_export(trainer, module, path, prompts, atol=1e-5):
    from transformers import AutoTokenizer, GenerationConfig

    trained_lp, exported_lp, mask = policy_and_export_log_probs(trainer, module, path, prompts)
    torch.testing.assert_close(exported_lp[mask], trained_lp[mask], rtol=0, atol=atol)
    assert AutoTokenizer.from_pretrained(path).pad_token_id == module.tokenizer.pad_token_id
    assert GenerationConfig.from_pretrained(path).eos_token_id is not None


def test_single_export_loads_in_transformers_with_the_policys_log_probs(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                        tmp_path):
    trainer, module = trained("single", tiny_config, bpe_tokenizer, gsm8k_prompts)
    with trainer:
        out = trainer.save_hf(tmp_path / "hf", max_shard_bytes=64 << 10)  # several shards and an index
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as transformers does
        check_export(trainer, module, out, gsm8k_prompts, atol=0)  # the same model, the same math
        bf16 = trainer.save_hf(tmp_path / "bf16", dtype=torch.bfloat16)
        assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
        with pytest.raises(FileExistsError, match="not an empty directory"):
            trainer.save_hf(out)
    assert not list(tmp_path.glob(".*tmp*"))  # nothing half-written left behind


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
def test_fsdp2_two_ranks_export_gathers_shards(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, ray_session):
    strategy = FSDP2Strategy(devices=2)
    trainer, module = trained(strategy, tiny_config, bpe_tokenizer, gsm8k_prompts,
                              rollout=Rollout(bucket_bytes=32 << 10))
    with trainer:
        out = trainer.save_hf(tmp_path / "hf")  # shards of one weight-sync bucket (32 KiB) each
        assert len(list(out.glob("*.safetensors"))) > 1
        check_export(trainer, module, out, gsm8k_prompts)


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
@needs_megatron
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_megatron_export_converts_the_layout_back(tp, pp, tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path,
                                                  ray_session):
    from rltrainer.strategies import MegatronStrategy

    strategy = MegatronStrategy(devices=2, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    trainer, module = trained(strategy, tiny_config, bpe_tokenizer, gsm8k_prompts,
                              rollout=Rollout(bucket_bytes=32 << 10), lr=1e-3)
    with trainer:
        out = trainer.save_hf(tmp_path / "hf")
        check_export(trainer, module, out, gsm8k_prompts)


def test_the_command_converts_a_checkpoint(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path):
    from safetensors.torch import load_file

    tiny_config.save_pretrained(tmp_path / "model")  # the run's model: a config (random init)
    bpe_tokenizer.save_pretrained(tmp_path / "model")
    trainer, module = trained("single", tiny_config, bpe_tokenizer, gsm8k_prompts, steps=1)
    with trainer:
        trainer.save_checkpoint(tmp_path / "step=1.ckpt")
        direct = trainer.save_hf(tmp_path / "direct")
    main([str(tmp_path / "step=1.ckpt"), str(tmp_path / "converted"), "--model", str(tmp_path / "model")])
    want, got = load_file(direct / "model.safetensors"), load_file(tmp_path / "converted" / "model.safetensors")
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_safetensors_writer_round_trips_views_of_one_buffer(tmp_path):
    from safetensors.torch import load_file

    buffer = torch.arange(10, dtype=torch.float32)
    tensors = [("a", buffer[:6].view(2, 3)), ("b", buffer[6:]), ("c", torch.ones(3, dtype=torch.bfloat16)),
               ("empty", torch.empty(0, 4))]
    write_safetensors(tmp_path / "x.safetensors", tensors)  # safetensors' save_file refuses shared storage
    loaded = load_file(tmp_path / "x.safetensors")
    for name, tensor in tensors:
        assert torch.equal(loaded[name], tensor), name

"""rltrainer.rollout.adapters: the directory vLLM's LoRARequest and SGLang's load_lora_adapter read
is the synced adapter in peft's format (peft loads it back to the same tensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rltrainer.lora import apply_lora
from rltrainer.models import build_causal_lm
from rltrainer.rollout.adapters import AdapterFiles

peft = pytest.importorskip("peft")


def test_synced_adapter_is_written_as_a_peft_directory(tiny_config):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    policy = apply_lora(build_causal_lm(tiny_config, seed=0), config, seed=1)
    adapter = peft.get_peft_model_state_dict(policy)  # peft's saved names: what a sync sends
    files = AdapterFiles(config, max_rank=16)
    stream = [("model.embed_tokens.weight", torch.zeros(2)), *adapter.items()]
    assert [n for n, _ in files.split(stream)] == ["model.embed_tokens.weight"]  # the base goes on
    assert files.dirty
    name, int_id, path = files.write()
    assert (int_id, files.dirty) == (1, False)
    loaded = peft.PeftModel.from_pretrained(build_causal_lm(tiny_config, seed=0), path)
    for key, tensor in peft.get_peft_model_state_dict(loaded).items():
        assert torch.equal(tensor, adapter[key]), key
    assert files.write()[1] == 2
    files.forget(1)
    files.cleanup()
    with pytest.raises(ValueError, match="max_lora_rank"):
        AdapterFiles(config, max_rank=2)


def test_an_adapter_config_as_a_dict_writes_the_same_file_peft_does(tmp_path):
    """An engine in another Python environment may have no peft: it gets adapter_config.json as a dict."""
    import json

    import peft

    from rltrainer.rollout.adapters import AdapterFiles, adapter_config_dict

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    as_dict = adapter_config_dict(config)
    assert all(type(v) in (str, int, float, bool, list, dict, type(None)) for v in as_dict.values())
    files = AdapterFiles(as_dict, max_rank=8)
    files.tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 8)}
    _, _, path = files.write()
    config.save_pretrained(str(tmp_path))
    ours, peft_s = (json.loads(p.read_text()) for p in (Path(path) / "adapter_config.json", tmp_path / "adapter_config.json"))
    assert set(ours.pop("target_modules")) == set(peft_s.pop("target_modules"))  # peft writes its set in any order
    assert ours == peft_s
    with pytest.raises(ValueError, match="r=4 exceeds the engine's max_lora_rank=2"):
        AdapterFiles(as_dict, max_rank=2)
    files.cleanup()

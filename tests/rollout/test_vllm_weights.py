"""The policy's weights in the form vLLM's loaders take, and the names vLLM must receive together,
without vLLM: transformers' reversal of its fused experts, the dry run of a
``load_weights`` (a fake vLLM model: fused layers through ``weight_loader``, a parameter written
directly, a loader that reads a value), the groups it makes, and the engine's refusal of names a
weight update would lose. The real engine: test_vllm_families.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rltrainer.rollout.vllm import VLLMEngine, VLLMPlatform
from rltrainer.rollout.vllm_weights import CheckpointForm, groups_by_layer, loading_layers, unplaced, written_directly
from rltrainer.testing import tiny_qwen2_config
from rltrainer.testing.families import tiny_config


def test_fused_experts_become_checkpoint_names_as_views():
    form = CheckpointForm(tiny_config("qwen3_moe", 64))
    assert not form.identity
    gate_up = torch.randn(8, 64, 64)  # [E, 2I, H]: gate_proj then up_proj of each expert
    down = torch.randn(8, 64, 32)  # [E, H, I]
    norm = torch.randn(64)
    out = dict(form.convert([("model.layers.1.mlp.experts.gate_up_proj", gate_up),
                             ("model.layers.1.mlp.experts.down_proj", down), ("model.norm.weight", norm)]))
    assert len(out) == 3 * 8 + 1
    for e in range(8):
        assert torch.equal(out[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"], gate_up[e, :32])
        assert torch.equal(out[f"model.layers.1.mlp.experts.{e}.up_proj.weight"], gate_up[e, 32:])
        assert torch.equal(out[f"model.layers.1.mlp.experts.{e}.down_proj.weight"], down[e])
    assert out["model.norm.weight"] is norm  # not converted: passed as it is


def test_mixtral_gets_its_checkpoint_names_and_a_dense_family_passes_through():
    mixtral = CheckpointForm(tiny_config("mixtral", 64))
    out = dict(mixtral.convert([("model.layers.0.mlp.gate.weight", torch.zeros(8, 64)),
                                ("model.layers.0.mlp.experts.down_proj", torch.zeros(8, 64, 64))]))
    assert {"model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.0.block_sparse_moe.experts.7.w2.weight"} <= set(out)
    dense = CheckpointForm(tiny_qwen2_config(64))
    weights = [("model.norm.weight", torch.zeros(64))]
    assert dense.identity and dense.convert(weights) == weights
    with pytest.raises(ValueError, match=r"transformers 9.9 builds Qwen2ForCausalLM without 1 of the policy's.*"
                                         r"install the trainer's transformers version"):
        dense.check_names(["model.norm.weight", "model.layers.0.mlp.experts.gate_up_proj"], "9.9")


class Loaded(torch.nn.Module):
    """A vLLM-like layer: its parameters carry a ``weight_loader`` (or not, like a plain one)."""

    def __init__(self, *shapes: tuple[int, ...], loader: bool = True) -> None:
        super().__init__()
        for i, shape in enumerate(shapes):
            param = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
            if loader:
                param.weight_loader = self.original_loader
            self.register_parameter(f"p{i}", param)

    @staticmethod
    def original_loader(param, weight, *args):
        param.data.copy_(weight)


class FakeVLLMModel(torch.nn.Module):
    """``qkv`` fused from ``q``/``k``/``v``; ``experts`` holds two parameters fed by ``gate_up`` and
    ``down``; ``sinks`` is written directly (as GPT-OSS's loader does); ``norm`` has no
    ``weight_loader`` (vLLM then calls ``default_weight_loader``); ``odd`` reads a value."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.experts, self.sinks = Loaded((6, 2)), Loaded((4, 2), (4, 2)), Loaded((2,))
        self.norm = Loaded((2,), loader=False)

    def load_weights(self, weights):
        for name, weight in weights:
            if name in ("q", "k", "v"):
                self.qkv.p0.weight_loader(self.qkv.p0, weight, name)
            elif name in ("gate_up", "down"):
                param = self.experts.p0 if name == "gate_up" else self.experts.p1
                param.weight_loader(param, weight, 0)
            elif name == "sinks":
                self.sinks.p0.data.copy_(weight)
            elif name == "norm":
                param = self.norm.p0
                getattr(param, "weight_loader", Loaded.original_loader)(param, weight)
            elif name == "odd":
                if weight.sum().item() > 0:
                    raise AssertionError
        return set()


def test_a_dry_run_finds_the_layers_each_name_reaches():
    model = FakeVLLMModel()
    names = ["q", "k", "v", "gate_up", "down", "sinks", "norm", "odd"]
    feeds = [[(n, torch.empty(2, device="meta"))] for n in names]
    layers = loading_layers(model, feeds)
    assert layers[:3] == [{"loader": ["qkv"], "direct": []}] * 3
    assert layers[3] == layers[4] == {"loader": ["experts"], "direct": []}
    assert layers[5] == {"loader": [], "direct": ["sinks"]}
    assert layers[6] == {"loader": ["norm"], "direct": []}
    assert isinstance(layers[7], str) and "meta" in layers[7]
    assert groups_by_layer(names, layers) == [["q", "k", "v"], ["gate_up", "down"]]
    assert written_directly(names, layers) == ["sinks"]
    assert [u.split(":")[0] for u in unplaced(names, layers)] == ["odd"]
    # the loaders are the model's again, and nothing was written
    assert model.qkv.p0.weight_loader == Loaded.original_loader and "weight_loader" not in model.norm.p0.__dict__
    assert all((p == 0).all() for p in model.parameters())


def test_groups_join_names_that_share_any_layer():
    layers = [{"loader": ["a"], "direct": []}, {"loader": ["b"], "direct": []}, {"loader": ["a", "b"], "direct": []},
              {"loader": ["c"], "direct": []}, "KeyError: x"]
    assert groups_by_layer(["n0", "n1", "n2", "n3", "n4"], layers) == [["n0", "n1", "n2"]]


class FakeLLM:
    """``apply_model`` runs the function on a fake vLLM model, here."""

    def __init__(self, model):
        self.model = model

    def apply_model(self, fn):
        return [fn(self.model)]


class NamedFake(FakeVLLMModel):
    """The fake model under checkpoint names of a tiny Qwen2 (one layer of it)."""

    NAMES = {"model.layers.0.self_attn.q_proj.weight": "q", "model.layers.0.self_attn.k_proj.weight": "k",
             "model.layers.0.self_attn.v_proj.weight": "v", "model.norm.weight": "norm"}

    def load_weights(self, weights):
        return super().load_weights((self.NAMES.get(n, n), w) for n, w in weights)


def engine_on(model, config) -> VLLMEngine:
    engine = VLLMEngine()
    engine.llm, engine.platform, engine._facts = FakeLLM(model), VLLMPlatform("cpu", False), {}
    engine._checkpoint = CheckpointForm(config)
    return engine


def test_the_engine_groups_names_by_vllms_dry_run_and_leaves_adapter_tensors_out():
    config = tiny_qwen2_config(64, num_layers=1)
    engine = engine_on(NamedFake(), config)
    adapter = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    names = [*NamedFake.NAMES, adapter]
    assert engine.weight_groups(names) == [list(NamedFake.NAMES)[:3]]


def test_the_engine_refuses_weights_vllm_would_write_around_its_update_session():
    class Sinks(NamedFake):
        NAMES = {**NamedFake.NAMES, "model.norm.weight": "sinks"}

    engine = engine_on(Sinks(), tiny_qwen2_config(64, num_layers=1))
    with pytest.raises(ValueError, match=r"writes 1 of the policy's weights straight into its parameters \(first: "
                                         r"\['model.norm.weight'\]\).*use rollout='hf'"):
        engine.weight_groups(list(Sinks.NAMES))


def test_a_sync_loads_checkpoint_names():
    engine = engine_on(NamedFake(), tiny_config("qwen3_moe", 64))
    calls = []
    sent = lambda info: calls.append([n for n, _ in info["update_info"]["weights"]])  # noqa: E731
    engine.llm = SimpleNamespace(update_weights=sent, start_weight_update=lambda: None,
                                 finish_weight_update=lambda: None, reset_prefix_cache=lambda: None)
    engine.update_weights([("model.layers.0.mlp.experts.down_proj", torch.zeros(8, 64, 32))])
    assert calls == [[f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(8)]]

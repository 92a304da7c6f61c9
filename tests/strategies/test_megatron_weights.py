"""HF <-> Megatron weight layouts: exact round trips over TP x PP for Qwen2 (QKV biases, tied
embeddings), Llama (untied) and Qwen3 (q/k norms, heads x head_dim != hidden, untied) with
grouped-query attention, and a check that the fused QKV and
gate/up shards are what megatron-core's attention and MLP code reads them as (not merely some
invertible layout)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from rltrainer.strategies.megatron.layouts import (MegatronLayout, expert_stack, hf_to_megatron, megatron_shard,
                                                   megatron_to_hf, stage_layers, state_reader)


def qwen2():
    return Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)


def llama():
    return LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)


def qwen3():
    return Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def state_of(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases and norms start at 0/1: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("make", [qwen2, llama, qwen3], ids=["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("fused", [False, True], ids=["local-spec", "te-spec"])
def test_round_trip_is_exact(make, tp, pp, fused):
    config = make()
    state = state_of(config)
    layout = MegatronLayout(tp=tp, pp=pp, fused_layernorm=fused, padded_vocab_size=128)
    shards = hf_to_megatron(state, config, layout)
    assert len(shards) == pp and all(len(stage) == tp for stage in shards)
    assert shards[0][0]["embedding.word_embeddings.weight"].shape == (128 // tp, 64)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in shards[-1][-1]  # stages number layers from 0
    if make is qwen3:  # one [head_dim] weight per layer, the same on every TP rank
        norm = "decoder.layers.1.self_attention.q_layernorm.weight"
        assert all(torch.equal(r[norm], shards[0][0][norm]) for r in shards[0]) and shards[0][0][norm].shape == (16,)
    back = megatron_to_hf(shards, config, layout)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_shards_read_the_way_megatron_core_reads_them():
    """megatron-core: ``mixed_qkv.view(..., ng_per_rank, (nq/ng + 2) * d)`` then split into
    ``[nq/ng * d, d, d]``; ``linear_fc1`` output ``chunk(2)`` into ``(gate, up)``."""
    config = qwen2()
    state = state_of(config)
    tp, heads, groups, d = 2, 8, 2, 8
    shards = hf_to_megatron(state, config, MegatronLayout(tp=tp))
    x = torch.randn(3, 64)
    q_ref = x @ state["model.layers.1.self_attn.q_proj.weight"].T + state["model.layers.1.self_attn.q_proj.bias"]
    k_ref = x @ state["model.layers.1.self_attn.k_proj.weight"].T + state["model.layers.1.self_attn.k_proj.bias"]
    gate_ref = x @ state["model.layers.1.mlp.gate_proj.weight"].T
    for r in range(tp):
        w = shards[0][r]["decoder.layers.1.self_attention.linear_qkv.weight"]
        b = shards[0][r]["decoder.layers.1.self_attention.linear_qkv.bias"]
        mixed = (x @ w.T + b).view(3, groups // tp, (heads // groups + 2) * d)
        q, k, _ = torch.split(mixed, [heads // groups * d, d, d], dim=2)
        q_heads = slice(r * heads // tp * d, (r + 1) * heads // tp * d)  # this rank's query heads
        torch.testing.assert_close(q.reshape(3, -1), q_ref[:, q_heads])
        torch.testing.assert_close(k.reshape(3, -1), k_ref[:, r * groups // tp * d:(r + 1) * groups // tp * d])
        fc1 = x @ shards[0][r]["decoder.layers.1.mlp.linear_fc1.weight"].T
        gate, _ = torch.chunk(fc1, 2, dim=-1)
        torch.testing.assert_close(gate, gate_ref.chunk(tp, dim=-1)[r])


def test_layouts_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="KV heads over tensor_parallel_size=4"):
        hf_to_megatron(state_of(qwen2()), qwen2(), MegatronLayout(tp=4))
    with pytest.raises(ValueError, match="pipeline_parallel_size=3"):
        hf_to_megatron(state_of(llama()), llama(), MegatronLayout(pp=3))


class Recorder(dict):
    """Over ``state``: a reader that records which rows of which tensors are read, and a lazy
    mapping (empty until looked up) that records the names looked up."""

    def __init__(self, state):
        super().__init__()
        self.state, self.reads, self.lookups = state, [], []

    def __getitem__(self, name):
        self.lookups.append(name)
        return self.state[name]

    def reader(self):
        def read(name, rows):
            self.reads.append((name, rows))
            return state_reader(self.state)(name, rows)

        return read


@pytest.mark.parametrize("make", [qwen2, llama], ids=["qwen2-tied", "llama-untied"])
@pytest.mark.parametrize("tp,pp", [(2, 2), (4, 1), (1, 2)])
def test_a_shard_reads_only_its_stage_and_its_rows(make, tp, pp):
    """Each shard reads its stage's tensors only; row-split ones (vocabulary, q/k/v, gate/up) only
    its rows; column-split ones (o_proj, down_proj) whole. What it reads is its shard plus the other
    ranks' columns of those. Equal to hf_to_megatron's shard, which reads only what it needs too."""
    config = make()
    if config.num_key_value_heads % tp:
        pytest.skip("KV heads do not divide")
    state = state_of(config)
    layout = MegatronLayout(tp=tp, pp=pp)
    layers = stage_layers(config.num_hidden_layers, pp)
    for stage in range(pp):
        for r in range(tp):
            rec = Recorder(state)
            shard = dict(megatron_shard(rec.reader(), config, layout, stage, r))
            outside = {"model.embed_tokens.weight"} if stage == 0 else set()  # what no layer holds
            if stage == pp - 1:
                outside |= {"model.norm.weight", "lm_head.weight" if not config.tie_word_embeddings
                            else "model.embed_tokens.weight" if pp > 1 else "model.norm.weight"}
            assert {n for n, _ in rec.reads if not n.startswith("model.layers.")} == outside, stage
            for name, rows in rec.reads:
                if name.startswith("model.layers."):
                    assert int(name.split(".")[2]) in layers[stage], (stage, name)
                whole = name.endswith(("o_proj.weight", "down_proj.weight", "norm.weight", "layernorm.weight"))
                assert (rows is None) == whole, (name, rows)
            read = sum(state[n][slice(*(rows or (None,)))].numel() for n, rows in rec.reads)
            held = sum(t.numel() for t in shard.values())
            columns = sum(state[n].numel() for n, rows in rec.reads if n.endswith(("o_proj.weight", "down_proj.weight")))
            assert read == held + columns * (tp - 1) // tp
            lazy = Recorder(state)
            only = hf_to_megatron(lazy, config, layout, only=(stage, r))[stage][r]
            assert only.keys() == shard.keys() and all(torch.equal(only[k], shard[k]) for k in shard)
            assert sorted(set(lazy.lookups)) == sorted({n for n, _ in rec.reads})


def qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=101, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)


def mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=101, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         tie_word_embeddings=True)


@pytest.mark.parametrize("make", [qwen3_moe, mixtral], ids=["qwen3_moe", "mixtral-tied"])
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (1, 1, 2), (1, 2, 4), (2, 2, 2), (2, 1, 1)])
@pytest.mark.parametrize("grouped", [False, True], ids=["sequential-mlp", "te-grouped-mlp"])
def test_moe_round_trip_is_exact(make, tp, pp, ep, grouped):
    """The fused transformers experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) split per
    expert over expert-parallel ranks (and each expert over tensor-parallel ranks, as a dense MLP),
    and back, exactly; in SequentialMLP's names and in TEGroupedMLP's (``linear_fc1.weight{j}``)."""
    config = make()
    state = state_of(config)
    layout = MegatronLayout(tp=tp, pp=pp, ep=ep, grouped_experts=grouped, fused_layernorm=grouped)
    shards = hf_to_megatron(state, config, layout)
    assert len(shards) == pp and all(len(stage) == ep * tp for stage in shards)
    experts, per = config.num_experts, config.num_experts // ep
    stack = "decoder.layers.1.mlp.experts.linear_fc1.weight"  # all of layer 1's experts' linear_fc1
    local = "decoder.layers.1.mlp.experts." + ("linear_fc1.weight{}" if grouped
                                               else "local_experts.{}.linear_fc1.weight")
    for r, shard in enumerate(shards[0]):
        held = sorted(index for name, index in filter(None, map(expert_stack, shard)) if name == stack)
        assert held == list(range(per)) and shard[local.format(0)].shape == (2 * 24 // tp, 32)
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in shard  # an MoE layer keeps its own norm
        e0 = (r // tp) * per  # this rank's first expert
        gate = state["model.layers.1.mlp.experts.gate_up_proj"][e0, :24].chunk(tp)[r % tp]
        assert torch.equal(shard[local.format(0)][: 24 // tp], gate)
        assert torch.equal(shard["decoder.layers.1.mlp.router.weight"], state["model.layers.1.mlp.gate.weight"])
    back = megatron_to_hf(shards, config, layout)
    assert back.keys() == state.keys() and experts % ep == 0
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_expert_shards_are_what_megatron_core_reads():
    """An expert's ``linear_fc1`` output ``chunk(2)`` is (gate, up) of transformers'
    ``gate_up_proj[e] @ x`` split as Qwen3MoeExperts splits it (``.chunk(2, dim=-1)``), and
    ``linear_fc2`` is ``down_proj[e]``, on each tensor-parallel rank's share of the intermediate size."""
    config, tp = qwen3_moe(), 2
    state = state_of(config)
    shards = hf_to_megatron(state, config, MegatronLayout(tp=tp, ep=2))
    x = torch.randn(3, 32)
    expert = 5  # expert-parallel rank 1, local expert 1
    gate_ref, up_ref = (x @ state["model.layers.2.mlp.experts.gate_up_proj"][expert].T).chunk(2, dim=-1)
    out_ref = (torch.nn.functional.silu(gate_ref) * up_ref) @ state["model.layers.2.mlp.experts.down_proj"][expert].T
    out = 0
    for r in range(tp):
        shard = shards[0][1 * tp + r]
        gate, up = (x @ shard["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"].T).chunk(2, dim=-1)
        torch.testing.assert_close(gate, gate_ref.chunk(tp, dim=-1)[r])
        out = out + (torch.nn.functional.silu(gate) * up) @ shard[
            "decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"].T  # row-parallel: summed over TP
    torch.testing.assert_close(out, out_ref)


@pytest.mark.parametrize("ep", [2, 4])
def test_a_moe_shard_reads_only_its_experts(ep):
    """Each expert-parallel rank reads only its experts' rows of the fused tensors, once each."""
    config = qwen3_moe()
    state = state_of(config)
    per = config.num_experts // ep
    for r in range(ep):
        rec = Recorder(state)
        dict(megatron_shard(rec.reader(), config, MegatronLayout(ep=ep), 0, 0, ep_rank=r))
        expert_reads = [(n, rows) for n, rows in rec.reads if ".mlp.experts." in n]
        assert len(expert_reads) == 2 * config.num_hidden_layers
        assert all(rows == (r * per, (r + 1) * per) for _, rows in expert_reads)


def test_moe_layouts_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="8 experts over expert_model_parallel_size=3"):
        hf_to_megatron(state_of(qwen3_moe()), qwen3_moe(), MegatronLayout(ep=3))

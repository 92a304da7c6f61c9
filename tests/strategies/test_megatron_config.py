"""``megatron_config``: every transformers config field is converted to the megatron-core setting
that computes the same thing, or refused with a ValueError naming it, its value, what is
supported and what to use instead. What was read in megatron-core 0.16.1 (paths under
``megatron/core/``) is cited next to each check.

RoPE is accepted only when megatron-core's frequencies equal transformers' exactly; these tests
compare the angles (position x inverse frequency, fp32) of megatron's own ``RotaryEmbedding``
with those of the family's transformers ``RotaryEmbedding`` with ``torch.equal``, independently of
the check the conversion itself runs. (That megatron with the converted arguments also gives
transformers' logits: test_megatron_cpu.py, ``llama3-rope``.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from rltrainer.strategies.megatron.config import megatron_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed (dev extra: pip install -e '.[dev]')")

SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama(**kw):
    return LlamaConfig(**{**SIZES, **kw})


def qwen2(**kw):
    return Qwen2Config(**{**SIZES, **kw})


def qwen3(**kw):
    return Qwen3Config(**{**SIZES, "head_dim": 32, **kw})


def qwen3_moe(**kw):
    return Qwen3MoeConfig(**{**SIZES, "head_dim": 32, "moe_intermediate_size": 24, "num_experts": 8,
                             "num_experts_per_tok": 2, **kw})


def mixtral(**kw):
    return MixtralConfig(**{**SIZES, "intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2, **kw})


def angles(config, gpt):
    """(transformers, megatron) RoPE angles [max_position_embeddings, head_dim / 2]."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rotary = {"llama": LlamaRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding, "qwen3": Qwen3RotaryEmbedding}
    hf = rotary[config.model_type](config)
    assert hf.attention_scaling == 1.0  # megatron's apply_rotary_pos_emb scales cos/sin by mscale=1 (rope_utils.py:122)
    # transformers' *RotaryEmbedding.forward: position_ids[..., None].float() * inv_freq
    n = config.max_position_embeddings
    hf_angles = torch.arange(n).float()[:, None] * hf.inv_freq
    # GPTModel builds RotaryEmbedding from these arguments (models/gpt/gpt_model.py:160-170)
    kv_channels = megatron_config(config).transformer["kv_channels"]
    mg = RotaryEmbedding(kv_channels=kv_channels, rotary_percent=gpt["rotary_percent"],
                         seq_len_interpolation_factor=gpt.get("seq_len_interpolation_factor"),
                         rotary_base=gpt["rotary_base"], rope_scaling=gpt.get("rope_scaling", False),
                         rope_scaling_factor=gpt.get("rope_scaling_factor", 8.0), use_cpu_initialization=True)
    return hf_angles, mg.get_freqs_non_repeated(n)


def test_families_convert_to_their_megatron_architecture():
    # transformer/transformer_config.py:133 kv_channels (default hidden / heads, line 933), :167
    # add_qkv_bias, :208 qk_layernorm
    for config, qkv_bias, qk_norm, head_dim in ((llama(), False, False, 16), (qwen2(), True, False, 16),
                                                (qwen3(), False, True, 32)):
        t = megatron_config(config).transformer
        assert (t["add_qkv_bias"], t["qk_layernorm"], t["kv_channels"]) == (qkv_bias, qk_norm, head_dim)
        assert (t["num_query_groups"], t["ffn_hidden_size"], t["add_bias_linear"]) == (2, 80, False)
    gpt = megatron_config(qwen3(tie_word_embeddings=False)).gpt
    assert gpt["share_embeddings_and_output_weights"] is False and gpt["position_embedding_type"] == "rope"


@pytest.mark.parametrize("config,expected", [
    (llama(), {"rotary_base": 10000.0}),
    (qwen2(rope_theta=1e6), {"rotary_base": 1e6}),
    (qwen3(rope_theta=1e6), {"rotary_base": 1e6}),
    # rotary_pos_embedding.py:136: megatron multiplies the positions by 1 / factor; transformers
    # divides the frequencies (modeling_rope_utils._compute_linear_scaling_rope_parameters): equal
    # in fp32 when 1 / factor is exact
    (llama(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
     {"seq_len_interpolation_factor": 4.0}),
    # rotary_pos_embedding.py:83-84 (rope_scaling -> _apply_scaling(factor=...)), Llama 3.1 / 3.2
    (llama(max_position_embeddings=131072, rope_parameters=dict(LLAMA3)),
     {"rope_scaling": True, "rope_scaling_factor": 8.0}),
    (llama(max_position_embeddings=131072, rope_parameters={**LLAMA3, "factor": 32.0}),
     {"rope_scaling": True, "rope_scaling_factor": 32.0}),
    (llama(max_position_embeddings=16384, rope_scaling={**LLAMA3, "factor": 32.0}),  # the legacy field name
     {"rope_scaling": True, "rope_scaling_factor": 32.0}),
], ids=["llama-default", "qwen2-theta1e6", "qwen3-theta1e6", "linear4", "llama3.1", "llama3.2", "rope_scaling-legacy"])
def test_accepted_rope_gives_transformers_angles_exactly(config, expected):
    gpt = megatron_config(config).gpt
    assert {k: gpt[k] for k in expected} == expected
    hf_angles, mg_angles = angles(config, gpt)
    assert torch.equal(hf_angles, mg_angles)


def test_llama3_angles_differ_without_megatron_scaling():
    """The angle comparison can fail: without rope_scaling, megatron's Llama 3.1 angles are off."""
    config = llama(max_position_embeddings=131072, rope_parameters=dict(LLAMA3))
    gpt = {**megatron_config(config).gpt, "rope_scaling": False}
    hf_angles, mg_angles = angles(config, gpt)
    assert not torch.equal(hf_angles, mg_angles)


REFUSED = [
    # (config, field named in the message, what the message says is supported)
    (lambda: LlamaConfig(**SIZES, hidden_act="gelu"), "hidden_act='gelu'", "'silu'"),
    (lambda: llama(attention_bias=True), "attention_bias=True", "False"),  # q/k/v and o_proj biases
    (lambda: qwen3(attention_bias=True), "attention_bias=True", "False"),
    (lambda: llama(mlp_bias=True), "mlp_bias=True", "False"),
    (lambda: llama(attention_dropout=0.1), "attention_dropout=0.1", "0.0"),
    # sliding-window layers (transformer_config.py:196 window_size is one window for all layers,
    # and the CPU attention spec has none)
    (lambda: qwen2(use_sliding_window=True, sliding_window=16, max_window_layers=1), r"layer_types=\[1\]",
     "full attention in every layer"),
    (lambda: qwen3(use_sliding_window=True, sliding_window=16, max_window_layers=0), r"layer_types=\[0, 1\]",
     "full attention in every layer"),
    (lambda: llama(partial_rotary_factor=0.5), "partial_rotary_factor=0.5", "1.0"),
    # no dynamic NTK / longrope in megatron-core; GPTModel's YaRN reads config.yarn_rotary_scaling_factor
    # (models/gpt/gpt_model.py:172-179) that no TransformerConfig defines
    (lambda: llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     r"rope_parameters\['rope_type'\]='dynamic'", "default, linear, llama3"),
    (lambda: qwen2(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                    "original_max_position_embeddings": 512}),
     r"rope_parameters\['rope_type'\]='yarn'", "default, linear, llama3"),
    # rotary_pos_embedding.py:92-98: _apply_scaling's other Llama 3 constants are hard-coded
    (lambda: llama(max_position_embeddings=131072, rope_parameters={**LLAMA3, "low_freq_factor": 2.0}),
     r"rope_parameters\['low_freq_factor'\]=2.0", "1 with rope_type='llama3'"),
    (lambda: llama(max_position_embeddings=131072, rope_parameters={**LLAMA3, "high_freq_factor": 8.0}),
     r"rope_parameters\['high_freq_factor'\]=8.0", "4 with rope_type='llama3'"),
    (lambda: llama(max_position_embeddings=131072,
                   rope_parameters={**LLAMA3, "original_max_position_embeddings": 4096}),
     r"rope_parameters\['original_max_position_embeddings'\]=4096", "8192 with rope_type='llama3'"),
    # a linear factor whose reciprocal is inexact: the angles differ in the last bits
    (lambda: llama(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 3.0}),
     "rope_parameters=", "differ by up to"),
    # mixtures of experts: dense layers among the sparse ones (Qwen3MoeDecoderLayer.__init__)
    (lambda: qwen3_moe(mlp_only_layers=[1]), r"mlp_only_layers=\[1\]", "a sparse MoE block in every layer"),
    (lambda: qwen3_moe(decoder_sparse_step=2), "decoder_sparse_step=2", "1: a sparse MoE block in every layer"),
    (lambda: qwen3_moe(use_sliding_window=True, sliding_window=16), "sliding_window=16", "None"),
    (lambda: mixtral(sliding_window=16), "sliding_window=16", "None"),
    # MixtralSparseMoeBlock.forward scales the hidden states both the router and the experts read
    (lambda: mixtral(router_jitter_noise=0.1), "router_jitter_noise=0.1", "the router's only"),
    # transformer_config.py:1636-1641: megatron refuses top-1 without moe_router_pre_softmax
    (lambda: mixtral(num_experts_per_tok=1), r"num_experts_per_tok=\(1, True\)", "1 only with norm_topk_prob=False"),
    (lambda: qwen3_moe(num_experts_per_tok=1, norm_topk_prob=True), r"num_experts_per_tok=\(1, True\)",
     "2 or more experts per token"),
]


@pytest.mark.parametrize("make,field,supported", REFUSED, ids=[f.replace("\\", "") for _, f, _ in REFUSED])
def test_unconvertible_field_is_refused_naming_it(make, field, supported):
    with pytest.raises(ValueError, match=rf"strategy='megatron' cannot convert {field}.*supports.*") as info:
        megatron_config(make())
    message = str(info.value)
    assert supported in message and "strategy='fsdp2'" in message


def test_other_families_and_experts_are_refused():
    """Qwen2-MoE (shared experts) is a family of its own, refused by model_type."""
    from transformers import GPT2Config, Qwen2MoeConfig

    with pytest.raises(ValueError, match=r"model_type='gpt2'.*llama, mixtral, qwen2, qwen3, qwen3_moe"):
        megatron_config(GPT2Config(n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"model_type='qwen2_moe'"):
        megatron_config(Qwen2MoeConfig(**SIZES))
    moe_llama = llama()
    moe_llama.num_local_experts = 8  # a field a dense family does not read, set by hand: refused all the same
    with pytest.raises(ValueError, match=r"num_local_experts=8.*no experts"):
        megatron_config(moe_llama)


@pytest.mark.parametrize("config,pre_softmax", [(qwen3_moe(norm_topk_prob=True), False),
                                                 (qwen3_moe(norm_topk_prob=False), True), (mixtral(), False),
                                                 (qwen3_moe(num_experts_per_tok=1), True)],
                         ids=["qwen3_moe-renormalised", "qwen3_moe", "mixtral", "qwen3_moe-top1"])
def test_mixtures_of_experts_convert_to_megatron_moe(config, pre_softmax):
    """Renormalised top-k weights: megatron's softmax over the top-k logits (moe_router_pre_softmax
    False, moe_utils.py:713-716); not renormalised: the softmax over all experts, then top-k (True,
    :709-711). Megatron's own load-balancing loss off: the Routing part adds transformers' (from the
    routers' record, test_megatron_moe.py)."""
    t = megatron_config(config).transformer
    experts = 8 if config.model_type == "qwen3_moe" else 4
    assert (t["num_moe_experts"], t["moe_router_topk"], t["moe_ffn_hidden_size"], t["ffn_hidden_size"]) == (
        experts, config.num_experts_per_tok, 24, 24)
    assert t["moe_router_pre_softmax"] is pre_softmax and t["moe_router_score_function"] == "softmax"
    assert (t["moe_router_load_balancing_type"], t["moe_aux_loss_coeff"]) == ("none", 0.0)
    assert t["qk_layernorm"] is (config.model_type == "qwen3_moe") and not t["add_qkv_bias"]


def test_fields_transformers_ignores_are_accepted():
    """``pretraining_tp`` (transformers 5's Llama no longer reads it) and sliding-window settings
    that leave every layer on full attention convert to the same architecture."""
    assert megatron_config(llama(pretraining_tp=2)) == megatron_config(llama())
    full = qwen2(use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert megatron_config(full) == megatron_config(qwen2())


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_refuses_at_setup_before_megatron_core_starts(rank, bpe_tokenizer):
    """A rank (here rank ``rank`` of 2, with no process group: any collective or megatron-core
    initialisation would fail otherwise) refuses the config right after ``configure_model``."""
    from rltrainer import GRPO
    from rltrainer.strategies.megatron import MegatronWorker
    from rltrainer.testing import length_reward

    config = llama(vocab_size=len(bpe_tokenizer), max_position_embeddings=4096,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                    "original_max_position_embeddings": 1024})
    module = GRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4)
    worker = MegatronWorker(rank=rank, world_size=2, device="cpu")
    options = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "precision": "32-true"}
    with pytest.raises(ValueError, match=r"cannot convert rope_parameters\['rope_type'\]='yarn'"):
        worker.setup(module, options, seed=0)

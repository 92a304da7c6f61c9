"""Tiny random configs of the model families people train, built from transformers' own config
classes (nothing downloaded): the family matrix's models (``tests/models/test_families.py``), and
a MoE policy for notebooks and recipes on a CPU.

Each is two decoder layers, hidden size 64, 4 query and 2 key/value heads, with the family's
distinguishing features switched on: Qwen3's q/k-norm, Gemma 2's logit soft-cap and alternating
sliding windows, Granite's logit scaling, Mistral's sliding window, gpt-oss's attention sinks and
expert biases, DeepSeek-V3's MLA (``kv_lora_rank + qk_rope_head_dim = 576``, the head size vLLM's
CPU MLA kernel takes), its dense first layer and shared expert, Qwen2-MoE's shared expert, Llama 4's
top-1 sigmoid router. MoE families have 8 experts, top-2 (Llama 4: 4, top-1). gpt-oss keeps its
own ``max_position_embeddings`` (its YaRN RoPE is defined against 4,096 original positions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Dense and mixture-of-experts families (transformers ``model_type``) of the matrix.
DENSE = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2", "granite")
MOE = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe", "qwen2_moe", "llama4_text")

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, use_cache=False)


def _families() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """Each family's config class and the fields that make it that family (over :data:`_COMMON`)."""
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, {}),
        "qwen2": (tf.Qwen2Config, {}),
        "qwen3": (tf.Qwen3Config, {"head_dim": 32}),
        "mistral": (tf.MistralConfig, {"sliding_window": 8}),
        "gemma2": (tf.Gemma2Config, {"tie_word_embeddings": True, "head_dim": 16, "sliding_window": 8,
                                     "final_logit_softcapping": 5.0}),
        "gemma3_text": (tf.Gemma3TextConfig, {"tie_word_embeddings": True, "head_dim": 16, "sliding_window": 8,
                                              "sliding_window_pattern": 2}),
        "phi3": (tf.Phi3Config, {}),
        "olmo2": (tf.Olmo2Config, {}),
        "granite": (tf.GraniteConfig, {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                       "attention_multiplier": 0.1}),
        "qwen3_moe": (tf.Qwen3MoeConfig, {"head_dim": 32, "moe_intermediate_size": 32, "num_experts": 8,
                                          "num_experts_per_tok": 2, "norm_topk_prob": True,
                                          "router_aux_loss_coef": 0.001}),
        "mixtral": (tf.MixtralConfig, {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}),
        "deepseek_v3": (tf.DeepseekV3Config, {"num_key_value_heads": 4, "moe_intermediate_size": 32,
                                              "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                                              "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                              "q_lora_rank": 48, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                              "qk_nope_head_dim": 32, "v_head_dim": 32}),
        "gpt_oss": (tf.GptOssConfig, {"max_position_embeddings": 131072, "head_dim": 16, "num_local_experts": 8,
                                      "num_experts_per_tok": 2, "sliding_window": 8, "router_aux_loss_coef": 0.01}),
        "olmoe": (tf.OlmoeConfig, {"num_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.01}),
        "qwen2_moe": (tf.Qwen2MoeConfig, {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                                          "num_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}),
        "llama4_text": (tf.Llama4TextConfig, {"head_dim": 16, "intermediate_size_mlp": 128, "num_local_experts": 4,
                                              "num_experts_per_tok": 1}),
    }


def tiny_config(family: str, vocab_size: int, **overrides: Any) -> Any:
    """A tiny random config of ``family`` (a transformers ``model_type`` of :data:`DENSE` or
    :data:`MOE`) for a vocabulary of ``vocab_size``; ``overrides`` replace any field. Token ids
    0-2 stay ordinary tokens: the config's pad, bos and eos ids are set to ``vocab_size - 1``."""
    families = _families()
    if family not in families:
        raise ValueError(f"No tiny config for family {family!r}; available: {', '.join(families)}")
    config_class, own = families[family]
    special = vocab_size - 1
    return config_class(**{**_COMMON, **own, "vocab_size": vocab_size, "pad_token_id": special,
                           "bos_token_id": special, "eos_token_id": special, **overrides})


def tiny_moe_config(vocab_size: int, **overrides: Any) -> Any:
    """A tiny Qwen3-MoE config (8 experts, top-2, q/k-norm), the MoE policy of the CPU recipes and
    notebooks."""
    return tiny_config("qwen3_moe", vocab_size, **overrides)

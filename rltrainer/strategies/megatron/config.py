"""A transformers config -> megatron-core settings: :func:`megatron_config`, the one place where
each field is either converted to the megatron-core setting that computes the same function or
refused with a ``ValueError`` that names it (what was received, what is supported, what to use).

Converted (megatron-core 0.16.1): the sizes; ``num_key_value_heads`` (grouped queries);
``head_dim`` (``kv_channels``, which may differ from ``hidden_size / num_attention_heads``);
``rms_norm_eps``; ``tie_word_embeddings``; Qwen2's QKV biases (``add_qkv_bias``); Qwen3's
per-head RMSNorm on queries and keys (``qk_layernorm``, applied before RoPE in both:
megatron ``transformer/attention.py:1477-1481`` in ``get_query_key_value_tensors``, RoPE after it
at ``:1097``; transformers ``Qwen3Attention.forward``); ``hidden_act="silu"`` (SwiGLU: ``gated_linear_unit`` with
``F.silu``); ``rope_parameters`` of ``rope_type`` ``default`` (``rotary_base``), ``linear``
(``seq_len_interpolation_factor``) and ``llama3`` (``rope_scaling``, ``rope_scaling_factor``)
when megatron-core computes the same angles, which :func:`check_rope` verifies numerically.
Ignored, as transformers 5 ignores them: ``pretraining_tp``, ``initializer_range``, token ids,
``use_cache``. Everything else that changes the function is refused (:data:`RULES`).

Mixtures of experts (Qwen3-MoE, Mixtral; :func:`moe_arguments`): every decoder layer a sparse
block of ``num_experts`` SwiGLU experts (``num_moe_experts``; each of ``moe_intermediate_size``,
Mixtral's ``intermediate_size``: ``moe_ffn_hidden_size``), ``num_experts_per_tok`` of them per token
(``moe_router_topk``) chosen by a bias-free linear router over a softmax of all experts. Top-k
weights renormalised to sum to 1 (Qwen3-MoE's ``norm_topk_prob=True``, Mixtral always) are
megatron-core's softmax over the top-k logits (``moe_router_pre_softmax=False``:
``exp(l_i) / sum_topk exp(l_j) = p_i / sum_topk p_j``, transformers' ``top_value /= sum``);
``norm_topk_prob=False`` is the softmax over all experts, then top-k
(``moe_router_pre_softmax=True``): megatron-core 0.16.1 ``transformer/moe/moe_utils.py``
``topk_routing_with_score_function`` lines 709-716, transformers ``Qwen3MoeTopKRouter`` /
``MixtralTopKRouter``. Megatron-core's own load-balancing losses are off
(``moe_router_load_balancing_type="none"``; no z-loss, jitter, capacity, token dropping, expert
bias, group-limited routing or top-k scaling: their defaults): the ``Routing`` part adds
transformers' ``load_balancing_loss_func`` from the routers' record, which megatron's routers fill
(:mod:`~rltrainer.strategies.megatron.routing`).
Refused: dense layers among the sparse ones (Qwen3-MoE's ``mlp_only_layers``,
``decoder_sparse_step``), a sliding window, Mixtral's ``router_jitter_noise`` (it scales the
experts' input too, megatron's ``moe_input_jitter_eps`` only the router's), and a renormalised
top-1 (megatron-core refuses top-1 without ``moe_router_pre_softmax``). Shared experts and
aux-loss-free router biases (Qwen2-MoE, DeepSeek-V3) are families of their own, refused by
``model_type``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Family:
    """What a transformers model family is, in megatron-core terms."""

    rotary: str  # the transformers RotaryEmbedding whose angles megatron's must equal
    qkv_bias: bool  # biases on q/k/v (not o_proj): megatron's add_qkv_bias
    qk_norm: bool  # RMSNorm over each head's queries and keys: megatron's qk_layernorm
    expert_ffn: str | None = None  # a mixture of experts: the config field of each expert's FFN size


FAMILIES: dict[str, Family] = {
    "llama": Family("transformers.models.llama.modeling_llama.LlamaRotaryEmbedding", qkv_bias=False, qk_norm=False),
    "qwen2": Family("transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding", qkv_bias=True, qk_norm=False),
    "qwen3": Family("transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding", qkv_bias=False, qk_norm=True),
    "qwen3_moe": Family("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding", qkv_bias=False,
                        qk_norm=True, expert_ffn="moe_intermediate_size"),
    "mixtral": Family("transformers.models.mixtral.modeling_mixtral.MixtralRotaryEmbedding", qkv_bias=False,
                      qk_norm=False, expert_ffn="intermediate_size"),
}
MOE_MODEL_TYPES = frozenset(name for name, family in FAMILIES.items() if family.expert_ffn)

# megatron-core 0.16.1 models/common/embeddings/rotary_pos_embedding.py: RotaryEmbedding.__init__
# (line 83-84) calls self._apply_scaling(inv_freq, factor=rope_scaling_factor) only, so the other
# Llama 3 constants are _apply_scaling's defaults (lines 92-98)
MEGATRON_LLAMA3 = {"low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}
ROPE_TYPES = ("default", "linear", "llama3")
FALLBACK = "use strategy='fsdp2' (or 'single'), which runs the transformers model itself"
ROPE_CHUNK = 1 << 16  # positions compared at a time (a 1M-position config needs no 256 MB table)


@dataclass(frozen=True)
class MegatronArchitecture:
    """``transformer``: ``TransformerConfig`` keyword arguments (the architecture; the caller adds
    parallelism and dtypes); ``gpt``: ``GPTModel`` keyword arguments (vocabulary, positions, tied
    output layer)."""

    transformer: dict[str, Any]
    gpt: dict[str, Any]


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE settings as transformers 5 reads them (``rope_parameters``; a legacy
    ``rope_scaling`` / ``rope_theta`` is moved there when the config is built)."""
    return dict(getattr(config, "rope_parameters", None) or {})


def _sliding_layers(config: Any) -> list[int]:
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind != "full_attention"]


def is_moe(config: Any) -> bool:
    """Whether ``config`` is of a mixture-of-experts family megatron converts (:data:`MOE_MODEL_TYPES`)."""
    return getattr(config, "model_type", None) in MOE_MODEL_TYPES


def renormalised(config: Any) -> bool:
    """Whether the top-k routing weights are divided by their sum (Qwen3-MoE's ``norm_topk_prob``;
    Mixtral always divides)."""
    return config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))


def _moe_field(name: str, default: Any = None) -> Callable[[Any], Any]:
    """Reads ``name`` of a MoE config (``default`` for a dense one: nothing to check)."""
    return lambda c: getattr(c, name, default) if is_moe(c) else default


def _llama3_constant(key: str, megatron_value: Any) -> Callable[[Any], Any]:
    """Reads ``rope_parameters[key]`` of a ``llama3`` RoPE (other RoPE types: ``megatron_value``, nothing to check)."""
    def read(config: Any) -> Any:
        rope = rope_parameters(config)
        return rope.get(key) if rope.get("rope_type") == "llama3" else megatron_value

    return read


@dataclass(frozen=True)
class Rule:
    """One field megatron-core cannot take as it is: ``read(config)`` is its value, ``ok(value)``
    whether the conversion handles it, ``supported`` says what it handles and ``fix`` what to do."""

    field: str
    read: Callable[[Any], Any]
    ok: Callable[[Any], bool]
    supported: str
    fix: str = FALLBACK


RULES: tuple[Rule, ...] = (
    Rule("model_type", lambda c: getattr(c, "model_type", None), lambda v: v in FAMILIES,
         f"the families {', '.join(sorted(FAMILIES))}", "use a model of one of these families"),
    Rule("hidden_act", lambda c: getattr(c, "hidden_act", "silu"), lambda v: v == "silu",
         "'silu' (SwiGLU: gated_linear_unit=True, activation_func=F.silu)"),
    Rule("attention_bias", lambda c: c.model_type != "qwen2" and bool(getattr(c, "attention_bias", False)),
         lambda v: not v, "False: transformers then puts biases on q/k/v and o_proj, megatron-core's add_qkv_bias "
         "covers q/k/v only (Qwen2's q/k/v biases are converted)"),
    Rule("mlp_bias", lambda c: bool(getattr(c, "mlp_bias", False)), lambda v: not v,
         "False (megatron-core's add_bias_linear would also add an o_proj bias)"),
    Rule("attention_dropout", lambda c: getattr(c, "attention_dropout", 0.0) or 0.0, lambda v: v == 0,
         "0.0 (the CPU attention and the log-prob ratios assume a deterministic forward)",
         "set attention_dropout=0.0, or " + FALLBACK),
    Rule("layer_types", _sliding_layers, lambda v: not v,
         "full attention in every layer (sliding-window layers: use_sliding_window=True with "
         "max_window_layers < num_hidden_layers; the value is the sliding layers' indexes)",
         "set use_sliding_window=False, or " + FALLBACK),
    Rule("partial_rotary_factor",
         lambda c: rope_parameters(c).get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None)),
         lambda v: v in (None, 1, 1.0), "1.0 (transformers' Llama / Qwen rotate the whole head)"),
    Rule("rope_parameters", lambda c: sorted(k for k in rope_parameters(c) if isinstance(rope_parameters(c)[k], dict)),
         lambda v: not v, "one RoPE for every layer (not a dict per layer type)"),
    Rule("rope_parameters['rope_type']", lambda c: rope_parameters(c).get("rope_type", "default"),
         lambda v: v in ROPE_TYPES,
         f"{', '.join(ROPE_TYPES)} (megatron-core 0.16 has no dynamic NTK or longrope RoPE, and its GPTModel "
         "reads YaRN settings, yarn_rotary_scaling_factor..., that no TransformerConfig of it defines)"),
    *(Rule(f"rope_parameters[{key!r}]", _llama3_constant(key, value), lambda v, value=value: v == value,
           f"{value} with rope_type='llama3' (megatron-core hard-codes it: rotary_pos_embedding.py _apply_scaling)")
      for key, value in MEGATRON_LLAMA3.items()),
    *(Rule(name, lambda c, name=name: None if is_moe(c) else getattr(c, name, None), lambda v: not v,
           f"no experts in a dense family (the mixture-of-experts families: {', '.join(sorted(MOE_MODEL_TYPES))})")
      for name in ("num_experts", "num_local_experts", "n_routed_experts")),
    Rule("mlp_only_layers", _moe_field("mlp_only_layers"), lambda v: not v,
         "a sparse MoE block in every layer (megatron's MoE layers here are all alike; the value is the "
         "dense layers' indexes)"),
    Rule("decoder_sparse_step", _moe_field("decoder_sparse_step", 1), lambda v: v in (None, 1),
         "1: a sparse MoE block in every layer"),
    Rule("sliding_window", _moe_field("sliding_window"), lambda v: v is None,
         "None (full attention in every layer)", "set use_sliding_window=False / sliding_window=None, or " + FALLBACK),
    Rule("router_jitter_noise", _moe_field("router_jitter_noise", 0.0), lambda v: not v,
         "0.0 (Mixtral's jitter scales the experts' input as well as the router's, megatron-core's "
         "moe_input_jitter_eps the router's only, and the log-prob ratios assume a deterministic forward)",
         "set router_jitter_noise=0.0, or " + FALLBACK),
    Rule("num_experts_per_tok", lambda c: (c.num_experts_per_tok, renormalised(c)) if is_moe(c) else (2, True),
         lambda v: v[0] >= 2 or not v[1],
         "2 or more experts per token with renormalised top-k weights (megatron-core refuses top-1 without "
         "moe_router_pre_softmax); 1 only with norm_topk_prob=False. The value is (num_experts_per_tok, renormalised)"),
)


def refuse(field: str, value: Any, config: Any, supported: str, fix: str) -> ValueError:
    return ValueError(f"strategy='megatron' cannot convert {field}={value!r} of this "
                      f"{getattr(config, 'model_type', type(config).__name__)} config: it supports {supported}. "
                      f"To train it, {fix}.")


def megatron_config(config: Any) -> MegatronArchitecture:
    """The megatron-core architecture of a transformers config (Llama, Qwen2, Qwen3, Qwen3-MoE,
    Mixtral), or a
    ``ValueError`` naming the first field megatron-core would compute differently."""
    for rule in RULES:
        value = rule.read(config)
        if not rule.ok(value):
            raise refuse(rule.field, value, config, rule.supported, rule.fix)
    family = FAMILIES[config.model_type]
    heads = config.num_attention_heads
    transformer = dict(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_attention_heads=heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
        kv_channels=getattr(config, "head_dim", None) or config.hidden_size // heads,
        ffn_hidden_size=config.intermediate_size, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps, add_bias_linear=False,
        add_qkv_bias=family.qkv_bias, qk_layernorm=family.qk_norm, hidden_dropout=0.0, attention_dropout=0.0)
    if family.expert_ffn:
        transformer.update(moe_arguments(config))
    gpt = dict(vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
               position_embedding_type="rope", share_embeddings_and_output_weights=bool(config.tie_word_embeddings),
               **rope_arguments(config))
    check_rope(config, transformer["kv_channels"], gpt)
    return MegatronArchitecture(transformer=transformer, gpt=gpt)


def moe_arguments(config: Any) -> dict[str, Any]:
    """``TransformerConfig``'s mixture-of-experts arguments for a Qwen3-MoE or Mixtral config (the
    caller adds ``expert_model_parallel_size``, the token dispatcher and grouped GEMM). Every MoE
    setting this relies on is named, the rest keep megatron-core 0.16.1's defaults
    (``transformer/transformer_config.py`` lines 534-725: no shared experts, ``moe_layer_freq=1``,
    softmax scores, no z-loss, jitter, capacity factor, expert bias or top-k scaling)."""
    expert_ffn = getattr(config, FAMILIES[config.model_type].expert_ffn)
    return dict(num_moe_experts=config.num_experts, moe_router_topk=config.num_experts_per_tok,
                ffn_hidden_size=expert_ffn, moe_ffn_hidden_size=expert_ffn,
                moe_router_pre_softmax=not renormalised(config), moe_router_score_function="softmax",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype=None)


def rope_arguments(config: Any) -> dict[str, Any]:
    """``GPTModel``'s RoPE arguments for the config's ``rope_parameters`` (a type in :data:`ROPE_TYPES`)."""
    rope = rope_parameters(config)
    kind, factor = rope.get("rope_type", "default"), rope.get("factor")
    out: dict[str, Any] = {"rotary_base": rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
                           "rotary_percent": 1.0}
    if kind == "linear":  # megatron divides the positions, transformers the frequencies
        out["seq_len_interpolation_factor"] = float(factor)
    elif kind == "llama3":
        out.update(rope_scaling=True, rope_scaling_factor=float(factor))
    return out


def check_rope(config: Any, kv_channels: int, gpt: dict[str, Any]) -> None:
    """Raise unless megatron-core's ``RotaryEmbedding`` built with ``gpt``'s arguments gives
    exactly the angles (position x inverse frequency, fp32) of the family's transformers
    ``RotaryEmbedding`` at every position below ``max_position_embeddings``, with no scaling of
    cos / sin (megatron's ``apply_rotary_pos_emb`` has ``mscale=1`` outside YaRN)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    module_name, _, cls_name = FAMILIES[config.model_type].rotary.rpartition(".")
    hf = getattr(importlib.import_module(module_name), cls_name)(config)
    rope = rope_parameters(config)
    if hf.attention_scaling != 1.0:
        raise refuse("rope_parameters", rope, config, f"RoPE without cos/sin scaling (got {hf.attention_scaling})",
                     FALLBACK)
    mg = RotaryEmbedding(kv_channels=kv_channels, rotary_percent=gpt["rotary_percent"],
                         seq_len_interpolation_factor=gpt.get("seq_len_interpolation_factor"),
                         rotary_base=gpt["rotary_base"], rope_scaling=gpt.get("rope_scaling", False),
                         rope_scaling_factor=gpt.get("rope_scaling_factor", 8.0), use_cpu_initialization=True)
    for start in range(0, config.max_position_embeddings, ROPE_CHUNK):
        n = min(ROPE_CHUNK, config.max_position_embeddings - start)
        hf_angles = torch.arange(start, start + n).float()[:, None] * hf.inv_freq.float()  # *RotaryEmbedding.forward
        mg_angles = mg.get_freqs_non_repeated(n, offset=start)  # [n, head_dim / 2]
        if hf_angles.shape != mg_angles.shape:
            where = f"their shapes differ: {tuple(hf_angles.shape)} vs {tuple(mg_angles.shape)}"
        elif not torch.equal(hf_angles, mg_angles):
            diff = (hf_angles - mg_angles).abs()
            where = f"they differ by up to {diff.max().item():.3g} rad (position {start + int(diff.amax(1).argmax())})"
        else:
            continue
        raise refuse("rope_parameters", rope, config,
                     f"RoPE whose angles megatron-core computes exactly as transformers does; for these {where}"
                     " (a linear factor must be a power of two: megatron scales positions by 1/factor)", FALLBACK)

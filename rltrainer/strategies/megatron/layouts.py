"""Weight layouts between transformers (HF names, full tensors) and megatron-core's ``GPTModel``
(tensor-parallel shards, pipeline stages), for the Llama / Qwen2 / Qwen3 families. Pure tensor
operations, exact both ways.

Megatron-core's layout (``megatron/core/transformer/attention.py``, ``mlp.py``):

- ``self_attention.linear_qkv``: Q, K and V fused, grouped by query group: for each of the ``ng``
  KV heads, its ``nq / ng`` query heads, then its K head, then its V head, ``d`` rows each.
  Tensor parallelism splits whole groups (``ng / tp`` per rank). Biases likewise.
- ``self_attention.linear_proj`` (``o_proj``): split along its input dimension.
- ``mlp.linear_fc1``: gate and up fused per rank, ``[gate shard; up shard]``;
  ``mlp.linear_fc2`` (``down_proj``) split along its input dimension.
- ``embedding.word_embeddings`` / ``output_layer``: vocabulary split along rows (padded to
  ``padded_vocab_size`` if given). Tied embeddings with pipeline stages: the last stage holds its
  own ``output_layer.weight`` copy.
- Qwen3's ``self_attn.q_norm`` / ``k_norm`` (one ``head_dim`` weight shared by every head) are
  ``self_attention.q_layernorm`` / ``k_layernorm``, replicated on every tensor-parallel rank (each
  applies them to its own heads), under both specs.
- Norms are replicated. With the Transformer Engine spec they fuse into the next linear
  (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); with the local spec they
  are ``input_layernorm`` / ``pre_mlp_layernorm``.
- Pipeline stage ``s`` holds layers ``[s * L / pp, (s + 1) * L / pp)``, numbered from 0 within
  the stage; the embedding is on the first stage, the final norm and output layer on the last.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

Shards = list[list[dict[str, torch.Tensor]]]  # [pp stage][tp rank] -> megatron name -> tensor
QK_NORMS = {"q_norm.weight": "self_attention.q_layernorm.weight",  # Qwen3: replicated over TP
            "k_norm.weight": "self_attention.k_layernorm.weight"}


@dataclass(frozen=True)
class MegatronLayout:
    tp: int = 1
    pp: int = 1
    fused_layernorm: bool = False  # Transformer Engine spec names
    padded_vocab_size: int | None = None


@dataclass(frozen=True)
class _Dims:
    layers: int
    heads: int
    groups: int
    head_dim: int
    hidden: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config: Any) -> _Dims:
        heads = config.num_attention_heads
        return cls(layers=config.num_hidden_layers, heads=heads,
                   groups=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   hidden=config.hidden_size, vocab=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)))


def stage_layers(num_layers: int, pp: int) -> list[range]:
    if num_layers % pp:
        raise ValueError(f"{num_layers} layers do not split evenly over pipeline_parallel_size={pp}")
    per = num_layers // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


def _check(dims: _Dims, layout: MegatronLayout) -> None:
    problems = []
    if dims.groups % layout.tp:
        problems.append(f"{dims.groups} KV heads over tensor_parallel_size={layout.tp}")
    if dims.heads % dims.groups:
        problems.append(f"{dims.heads} query heads over {dims.groups} KV heads")
    if problems:
        raise ValueError("Megatron layout does not divide: " + "; ".join(problems))


def _norm_names(layout: MegatronLayout) -> tuple[str, str]:
    if layout.fused_layernorm:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: _Dims, tp: int) -> list[torch.Tensor]:
    """HF ``q_proj``/``k_proj``/``v_proj`` weights (or biases) -> ``linear_qkv`` shard per TP rank."""
    rest = q.shape[1:]
    per_group = dims.heads // dims.groups
    qg = q.reshape(dims.groups, per_group * dims.head_dim, *rest)
    kg = k.reshape(dims.groups, dims.head_dim, *rest)
    vg = v.reshape(dims.groups, dims.head_dim, *rest)
    fused = torch.cat([qg, kg, vg], dim=1)  # [ng, (nq/ng + 2) * d, ...]
    return [part.reshape(-1, *rest).contiguous() for part in fused.chunk(tp, dim=0)]


def split_qkv(shards: list[torch.Tensor], dims: _Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_qkv`` shards -> HF ``q_proj``, ``k_proj``, ``v_proj``."""
    rest = shards[0].shape[1:]
    per_group = dims.heads // dims.groups
    fused = torch.cat([s.reshape(-1, (per_group + 2) * dims.head_dim, *rest) for s in shards])  # [ng, ...]
    q, k, v = fused.split([per_group * dims.head_dim, dims.head_dim, dims.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_vocab(t: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    size = layout.padded_vocab_size
    if size is None or size == t.shape[0]:
        return t
    if size < t.shape[0]:
        raise ValueError(f"padded_vocab_size={size} is smaller than the vocabulary ({t.shape[0]})")
    return torch.cat([t, t.new_zeros(size - t.shape[0], *t.shape[1:])])


def hf_to_megatron(state: Mapping[str, torch.Tensor], config: Any, layout: MegatronLayout,
                   only: tuple[int, int] | None = None) -> Shards:
    """A transformers state dict -> megatron-core state dicts, ``[pp stage][tp rank]``.

    ``only=(stage, tp_rank)`` fills just that shard (the others stay empty): what one rank needs,
    without holding every rank's copy."""
    dims = _Dims.of(config)
    _check(dims, layout)
    tp = layout.tp
    shards: Shards = [[{} for _ in range(tp)] for _ in range(layout.pp)]
    norm_attn, norm_mlp = _norm_names(layout)

    def put(stage: int, name: str, parts: list[torch.Tensor] | torch.Tensor) -> None:
        for r in range(tp):
            if only is None or only == (stage, r):
                shards[stage][r][name] = parts[r] if isinstance(parts, list) else parts.clone()

    def rows(t: torch.Tensor) -> list[torch.Tensor]:
        return [c.contiguous() for c in t.chunk(tp, dim=0)]

    def cols(t: torch.Tensor) -> list[torch.Tensor]:
        return [c.contiguous() for c in t.chunk(tp, dim=1)]

    embed = _pad_vocab(state["model.embed_tokens.weight"], layout)
    put(0, "embedding.word_embeddings.weight", rows(embed))
    for stage, layers in enumerate(stage_layers(dims.layers, layout.pp)):
        if only is not None and only[0] != stage:
            continue
        for local, i in enumerate(layers):
            hf, mg = f"model.layers.{i}.", f"decoder.layers.{local}."
            a = hf + "self_attn."
            put(stage, mg + "self_attention.linear_qkv.weight",
                fuse_qkv(state[a + "q_proj.weight"], state[a + "k_proj.weight"], state[a + "v_proj.weight"], dims, tp))
            if a + "q_proj.bias" in state:
                put(stage, mg + "self_attention.linear_qkv.bias",
                    fuse_qkv(state[a + "q_proj.bias"], state[a + "k_proj.bias"], state[a + "v_proj.bias"], dims, tp))
            put(stage, mg + "self_attention.linear_proj.weight", cols(state[a + "o_proj.weight"]))
            for hf_norm, mg_norm in QK_NORMS.items():
                if a + hf_norm in state:
                    put(stage, mg + mg_norm, state[a + hf_norm])
            m = hf + "mlp."
            gate, up = rows(state[m + "gate_proj.weight"]), rows(state[m + "up_proj.weight"])
            put(stage, mg + "mlp.linear_fc1.weight", [torch.cat([g, u]) for g, u in zip(gate, up)])
            put(stage, mg + "mlp.linear_fc2.weight", cols(state[m + "down_proj.weight"]))
            put(stage, mg + norm_attn, state[hf + "input_layernorm.weight"])
            put(stage, mg + norm_mlp, state[hf + "post_attention_layernorm.weight"])
    last = layout.pp - 1
    put(last, "decoder.final_layernorm.weight", state["model.norm.weight"])
    if not dims.tied:
        put(last, "output_layer.weight", rows(_pad_vocab(state["lm_head.weight"], layout)))
    elif layout.pp > 1:  # the last stage keeps its own copy of the tied embedding
        put(last, "output_layer.weight", rows(embed))
    return shards


def hf_names_of(megatron_name: str, config: Any, layout: MegatronLayout, stage: int = 0) -> list[str]:
    """The transformers parameters a megatron-core parameter (of pipeline stage ``stage``) holds."""
    dims = _Dims.of(config)
    norm_attn, norm_mlp = _norm_names(layout)
    if megatron_name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if megatron_name == "output_layer.weight":
        return [] if dims.tied else ["lm_head.weight"]  # tied: a copy of the embedding
    if megatron_name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    prefix = "decoder.layers."
    if not megatron_name.startswith(prefix):
        raise KeyError(f"No transformers counterpart for megatron parameter {megatron_name!r}")
    local, rest = megatron_name[len(prefix):].split(".", 1)
    hf = f"model.layers.{stage_layers(dims.layers, layout.pp)[stage][int(local)]}."
    names = {
        "self_attention.linear_qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"],
        "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
        "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
        "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
        **{mg_norm: ["self_attn." + hf_norm] for hf_norm, mg_norm in QK_NORMS.items()},
        norm_attn: ["input_layernorm.weight"],
        norm_mlp: ["post_attention_layernorm.weight"],
    }.get(rest)
    if names is None:
        raise KeyError(f"No transformers counterpart for megatron parameter {megatron_name!r}")
    return [hf + n for n in names]


def hf_from_megatron(megatron_name: str, tp_shards: list[torch.Tensor], config: Any, layout: MegatronLayout,
                     stage: int = 0) -> dict[str, torch.Tensor]:
    """One megatron-core parameter, given its shard on every tensor-parallel rank -> the full
    transformers tensors it holds (see :func:`hf_names_of`)."""
    dims = _Dims.of(config)
    names = hf_names_of(megatron_name, config, layout, stage)
    if not names:
        return {}
    if megatron_name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return dict(zip(names, split_qkv(tp_shards, dims)))
    if megatron_name.endswith("linear_fc1.weight"):
        halves = [t.chunk(2) for t in tp_shards]  # per rank: [gate shard; up shard]
        return {names[0]: torch.cat([g for g, _ in halves]), names[1]: torch.cat([u for _, u in halves])}
    if megatron_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return {names[0]: torch.cat(tp_shards, dim=1)}  # split along the input dimension
    if megatron_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return {names[0]: torch.cat(tp_shards)[: dims.vocab]}  # vocabulary rows, padding dropped
    return {names[0]: tp_shards[0]}  # norms: replicated


def megatron_to_hf(shards: Shards, config: Any, layout: MegatronLayout) -> dict[str, torch.Tensor]:
    """megatron-core state dicts ``[pp stage][tp rank]`` -> a transformers state dict (full tensors)."""
    _check(_Dims.of(config), layout)
    out: dict[str, torch.Tensor] = {}
    for stage, ranks in enumerate(shards):
        for name in ranks[0]:
            out.update(hf_from_megatron(name, [ranks[r][name] for r in range(layout.tp)], config, layout, stage))
    return out

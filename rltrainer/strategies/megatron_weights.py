"""Weight layouts between transformers (HF names, full tensors) and megatron-core's ``GPTModel``
(tensor-parallel shards, pipeline stages), for the Qwen2 / Llama family. Pure tensor operations,
exact both ways.

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


def hf_to_megatron(state: Mapping[str, torch.Tensor], config: Any, layout: MegatronLayout) -> Shards:
    """A transformers state dict -> megatron-core state dicts, ``[pp stage][tp rank]``."""
    dims = _Dims.of(config)
    _check(dims, layout)
    tp = layout.tp
    shards: Shards = [[{} for _ in range(tp)] for _ in range(layout.pp)]
    norm_attn, norm_mlp = _norm_names(layout)

    def put(stage: int, name: str, parts: list[torch.Tensor] | torch.Tensor) -> None:
        for r in range(tp):
            shards[stage][r][name] = parts[r] if isinstance(parts, list) else parts.clone()

    def rows(t: torch.Tensor) -> list[torch.Tensor]:
        return [c.contiguous() for c in t.chunk(tp, dim=0)]

    def cols(t: torch.Tensor) -> list[torch.Tensor]:
        return [c.contiguous() for c in t.chunk(tp, dim=1)]

    embed = _pad_vocab(state["model.embed_tokens.weight"], layout)
    put(0, "embedding.word_embeddings.weight", rows(embed))
    for stage, layers in enumerate(stage_layers(dims.layers, layout.pp)):
        for local, i in enumerate(layers):
            hf, mg = f"model.layers.{i}.", f"decoder.layers.{local}."
            a = hf + "self_attn."
            put(stage, mg + "self_attention.linear_qkv.weight",
                fuse_qkv(state[a + "q_proj.weight"], state[a + "k_proj.weight"], state[a + "v_proj.weight"], dims, tp))
            if a + "q_proj.bias" in state:
                put(stage, mg + "self_attention.linear_qkv.bias",
                    fuse_qkv(state[a + "q_proj.bias"], state[a + "k_proj.bias"], state[a + "v_proj.bias"], dims, tp))
            put(stage, mg + "self_attention.linear_proj.weight", cols(state[a + "o_proj.weight"]))
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


def megatron_to_hf(shards: Shards, config: Any, layout: MegatronLayout) -> dict[str, torch.Tensor]:
    """megatron-core state dicts ``[pp stage][tp rank]`` -> a transformers state dict (full tensors)."""
    dims = _Dims.of(config)
    _check(dims, layout)
    norm_attn, norm_mlp = _norm_names(layout)
    out: dict[str, torch.Tensor] = {}

    def gather(stage: int, name: str, dim: int) -> torch.Tensor:
        return torch.cat([shards[stage][r][name] for r in range(layout.tp)], dim=dim)

    embed = gather(0, "embedding.word_embeddings.weight", 0)[: dims.vocab]
    out["model.embed_tokens.weight"] = embed
    for stage, layers in enumerate(stage_layers(dims.layers, layout.pp)):
        first = shards[stage][0]
        for local, i in enumerate(layers):
            hf, mg = f"model.layers.{i}.", f"decoder.layers.{local}."
            q, k, v = split_qkv([shards[stage][r][mg + "self_attention.linear_qkv.weight"] for r in range(layout.tp)], dims)
            out.update({hf + "self_attn.q_proj.weight": q, hf + "self_attn.k_proj.weight": k,
                        hf + "self_attn.v_proj.weight": v})
            if mg + "self_attention.linear_qkv.bias" in first:
                q, k, v = split_qkv([shards[stage][r][mg + "self_attention.linear_qkv.bias"] for r in range(layout.tp)],
                                    dims)
                out.update({hf + "self_attn.q_proj.bias": q, hf + "self_attn.k_proj.bias": k,
                            hf + "self_attn.v_proj.bias": v})
            out[hf + "self_attn.o_proj.weight"] = gather(stage, mg + "self_attention.linear_proj.weight", 1)
            fc1 = [shards[stage][r][mg + "mlp.linear_fc1.weight"].chunk(2) for r in range(layout.tp)]
            out[hf + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
            out[hf + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
            out[hf + "mlp.down_proj.weight"] = gather(stage, mg + "mlp.linear_fc2.weight", 1)
            out[hf + "input_layernorm.weight"] = first[mg + norm_attn]
            out[hf + "post_attention_layernorm.weight"] = first[mg + norm_mlp]
    last = layout.pp - 1
    out["model.norm.weight"] = shards[last][0]["decoder.final_layernorm.weight"]
    if not dims.tied:
        out["lm_head.weight"] = gather(last, "output_layer.weight", 0)[: dims.vocab]
    return out

"""Weight layouts between transformers (HF names, full tensors) and megatron-core's ``GPTModel``
(tensor-parallel shards, pipeline stages, expert-parallel shares), for the Llama / Qwen2 / Qwen3
families and the Qwen3-MoE / Mixtral mixtures of experts. Pure tensor operations, exact both ways.

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
- A mixture of experts (``moe_layer.py``, ``experts.py``, ``router.py``): the router
  ``mlp.router.weight [E, H]`` is transformers' ``mlp.gate.weight``, replicated. Transformers
  stores the experts fused, ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and
  ``mlp.experts.down_proj [E, H, I]``; expert-parallel rank ``r`` of ``ep`` holds experts
  ``[r * E / ep, (r + 1) * E / ep)`` as its local experts ``0 .. E / ep - 1``, each an ``MLP``
  like the dense one (``SequentialMLP``: ``mlp.experts.local_experts.{j}.linear_fc1.weight``
  ``[gate shard; up shard]`` and ``linear_fc2.weight``; Transformer Engine's ``TEGroupedMLP``:
  ``mlp.experts.linear_fc1.weight{j}`` and ``linear_fc2.weight{j}``), split over the tensor-parallel
  ranks as the dense MLP is (``expert_tensor_parallel_size`` = TP). Its norm is always
  ``pre_mlp_layernorm`` (megatron fuses no norm into an MoE layer). Everything else is replicated
  over expert-parallel ranks (they are data-parallel ranks for it), and so is all of a dense model.
- A stage's ranks are numbered ``ep_rank * tp + tp_rank`` (:data:`Shards`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

Shards = list[list[dict[str, torch.Tensor]]]  # [pp stage][ep rank * tp + tp rank] -> megatron name -> tensor
QK_NORMS = {"q_norm.weight": "self_attention.q_layernorm.weight",  # Qwen3: replicated over TP
            "k_norm.weight": "self_attention.k_layernorm.weight"}
EXPERT_HF = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}  # megatron expert linear -> HF fused tensor
#: a megatron expert parameter: ``decoder.layers.{l}.mlp.experts.`` + SequentialMLP's or TEGroupedMLP's name
_STACK = re.compile(r"decoder\.layers\.\d+\.mlp\.experts\.linear_fc[12]\.weight")  # see expert_stack
_EXPERT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight"
                     r"|(linear_fc[12])\.weight(\d+))")


@dataclass(frozen=True)
class MegatronLayout:
    tp: int = 1
    pp: int = 1
    fused_layernorm: bool = False  # Transformer Engine spec names
    padded_vocab_size: int | None = None
    ep: int = 1  # expert-parallel ranks (a mixture of experts)
    grouped_experts: bool = False  # experts as Transformer Engine's TEGroupedMLP names them (grouped GEMM)


@dataclass(frozen=True)
class _Dims:
    layers: int
    heads: int
    groups: int
    head_dim: int
    hidden: int
    vocab: int
    tied: bool
    qkv_bias: bool  # as build_gpt builds it: Qwen2 always, Llama with attention_bias
    qk_norm: bool  # Qwen3's (and Qwen3-MoE's) q_norm / k_norm
    ffn: int  # the MLP's (a mixture of experts: each expert's) intermediate size
    experts: int = 0  # a mixture of experts: how many (0: a dense MLP)

    @classmethod
    def of(cls, config: Any) -> _Dims:
        heads = config.num_attention_heads
        moe = config.model_type in ("qwen3_moe", "mixtral")
        return cls(layers=config.num_hidden_layers, heads=heads,
                   groups=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   hidden=config.hidden_size, vocab=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
                   qk_norm=config.model_type in ("qwen3", "qwen3_moe"),
                   ffn=config.moe_intermediate_size if config.model_type == "qwen3_moe" else config.intermediate_size,
                   experts=config.num_experts if moe else 0)


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
    if layout.ep > 1 and dims.experts % layout.ep:
        problems.append(f"{dims.experts} experts over expert_model_parallel_size={layout.ep}")
    if problems:
        raise ValueError("Megatron layout does not divide: " + "; ".join(problems))


def _norm_names(layout: MegatronLayout, dims: _Dims) -> tuple[str, str]:
    if layout.fused_layernorm:  # an MoE layer keeps its own pre_mlp_layernorm (gpt_layer_specs.py:265)
        return ("self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight" if dims.experts else "mlp.linear_fc1.layer_norm_weight")
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def expert_name(local_layer: int, local_expert: int, linear: str, layout: MegatronLayout) -> str:
    """The megatron name of local expert ``local_expert``'s ``linear`` (``linear_fc1`` / ``linear_fc2``)
    weight in decoder layer ``local_layer`` of a stage."""
    experts = f"decoder.layers.{local_layer}.mlp.experts."
    if layout.grouped_experts:
        return f"{experts}{linear}.weight{local_expert}"
    return f"{experts}local_experts.{local_expert}.{linear}.weight"


def expert_stack(megatron_name: str) -> tuple[str, int] | None:
    """For a megatron expert weight (either naming), the name of the stack of that weight over all
    experts of its layer, ``decoder.layers.{l}.mlp.experts.{linear}.weight`` (what
    :func:`hf_from_megatron` converts; no parameter of megatron's has it), and its local expert
    index; ``None`` for any other parameter."""
    match = _EXPERT.fullmatch(megatron_name)
    if match is None:
        return None
    layer, sequential, sequential_linear, grouped_linear, grouped = match.groups()
    linear = sequential_linear or grouped_linear
    return f"decoder.layers.{layer}.mlp.experts.{linear}.weight", int(sequential if sequential is not None else grouped)


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


Rows = tuple[int, int] | None  # rows [start, stop) of a tensor's first dimension; None: the whole tensor
Reader = Callable[[str, Rows], torch.Tensor]  # (HF name, rows) -> those rows of that transformers tensor


def state_reader(state: Mapping[str, torch.Tensor]) -> Reader:
    """A :data:`Reader` over full tensors (rows are views). ``state`` may be lazy: only the names
    a shard needs are looked up."""
    def read(name: str, rows: Rows) -> torch.Tensor:
        tensor = state[name]
        return tensor if rows is None else tensor[rows[0]:rows[1]]

    return read


def _chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """Rows of part ``index`` of ``torch.chunk(n rows, parts)``."""
    size = -(-n // parts)
    return min(index * size, n), min((index + 1) * size, n)


def _vocab_rows(read: Reader, name: str, dims: _Dims, layout: MegatronLayout, tp_rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s vocabulary rows of ``name`` (padded: rows past the
    vocabulary are zeros); only the rows it holds are read."""
    size = layout.padded_vocab_size or dims.vocab
    if size < dims.vocab:
        raise ValueError(f"padded_vocab_size={size} is smaller than the vocabulary ({dims.vocab})")
    start, stop = _chunk(size, layout.tp, tp_rank)
    real = read(name, (min(start, dims.vocab), min(stop, dims.vocab)))
    if real.shape[0] == stop - start:
        return real.contiguous()
    return torch.cat([real, real.new_zeros(stop - start - real.shape[0], *real.shape[1:])])


def _qkv_rows(read: Reader, prefix: str, suffix: str, dims: _Dims, tp: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s ``linear_qkv`` shard: only the q/k/v rows of its query groups are read."""
    g0, g1 = _chunk(dims.groups, tp, tp_rank)
    per_group = dims.heads // dims.groups
    q = read(f"{prefix}q_proj.{suffix}", (g0 * per_group * dims.head_dim, g1 * per_group * dims.head_dim))
    k = read(f"{prefix}k_proj.{suffix}", (g0 * dims.head_dim, g1 * dims.head_dim))
    v = read(f"{prefix}v_proj.{suffix}", (g0 * dims.head_dim, g1 * dims.head_dim))
    return fuse_qkv(q, k, v, replace(dims, groups=g1 - g0, heads=(g1 - g0) * per_group), 1)[0]


def _columns(t: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=1)[tp_rank].contiguous()


def megatron_shard(read: Reader, config: Any, layout: MegatronLayout, stage: int, tp_rank: int, ep_rank: int = 0
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pipeline stage ``stage``, tensor-parallel rank ``tp_rank``'s (and, for a mixture of experts,
    expert-parallel rank ``ep_rank``'s) megatron-core tensors, one at a time, from transformers
    tensors ``read`` returns. Only what this shard holds is read: its stage's tensors, and of the
    row-split ones (vocabulary, q/k/v of its query groups, gate/up, its experts) its rows; a
    column-split tensor (``o_proj``, ``down_proj``) is read whole and sliced, one at a time (its
    experts' ``down_proj`` likewise, in one read). Equal to :func:`hf_to_megatron`'s
    ``[stage][ep_rank * tp + tp_rank]`` (which is built from it)."""
    dims = _Dims.of(config)
    _check(dims, layout)
    tp, last = layout.tp, layout.pp - 1
    norm_attn, norm_mlp = _norm_names(layout, dims)
    if stage == 0:
        yield "embedding.word_embeddings.weight", _vocab_rows(read, "model.embed_tokens.weight", dims, layout, tp_rank)
    for local, i in enumerate(stage_layers(dims.layers, layout.pp)[stage]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{local}."
        a, m = hf + "self_attn.", hf + "mlp."
        yield mg + "self_attention.linear_qkv.weight", _qkv_rows(read, a, "weight", dims, tp, tp_rank)
        if dims.qkv_bias:
            yield mg + "self_attention.linear_qkv.bias", _qkv_rows(read, a, "bias", dims, tp, tp_rank)
        yield mg + "self_attention.linear_proj.weight", _columns(read(a + "o_proj.weight", None), tp, tp_rank)
        if dims.qk_norm:  # replicated over TP
            for hf_norm, mg_norm in QK_NORMS.items():
                yield mg + mg_norm, read(a + hf_norm, None)
        if dims.experts:
            yield from _expert_shard(read, dims, layout, local, m, tp_rank, ep_rank)
        else:
            rows = _chunk(dims.ffn, tp, tp_rank)
            yield mg + "mlp.linear_fc1.weight", torch.cat([read(m + "gate_proj.weight", rows),
                                                           read(m + "up_proj.weight", rows)])
            yield mg + "mlp.linear_fc2.weight", _columns(read(m + "down_proj.weight", None), tp, tp_rank)
        yield mg + norm_attn, read(hf + "input_layernorm.weight", None)
        yield mg + norm_mlp, read(hf + "post_attention_layernorm.weight", None)
    if stage == last:
        yield "decoder.final_layernorm.weight", read("model.norm.weight", None)
        if not dims.tied:
            yield "output_layer.weight", _vocab_rows(read, "lm_head.weight", dims, layout, tp_rank)
        elif layout.pp > 1:  # the last stage keeps its own copy of the tied embedding
            yield "output_layer.weight", _vocab_rows(read, "model.embed_tokens.weight", dims, layout, tp_rank)


def _expert_shard(read: Reader, dims: _Dims, layout: MegatronLayout, local: int, hf_mlp: str, tp_rank: int,
                  ep_rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """One MoE layer's router and this rank's experts (rows ``[ep_rank * E / ep, ...)`` of the fused
    transformers tensors, read once each), each expert's weights split over TP as a dense MLP's."""
    yield f"decoder.layers.{local}.mlp.router.weight", read(hf_mlp + "gate.weight", None)
    per = dims.experts // layout.ep
    own = (ep_rank * per, (ep_rank + 1) * per)
    gate_up = read(hf_mlp + "experts.gate_up_proj", own)  # [E/ep, 2I, H]
    g0, g1 = _chunk(dims.ffn, layout.tp, tp_rank)
    for j, expert in enumerate(gate_up):
        gate, up = expert[:dims.ffn], expert[dims.ffn:]
        yield expert_name(local, j, "linear_fc1", layout), torch.cat([gate[g0:g1], up[g0:g1]])
    del gate_up
    down = read(hf_mlp + "experts.down_proj", own)  # [E/ep, H, I]
    for j, expert in enumerate(down):
        yield expert_name(local, j, "linear_fc2", layout), _columns(expert, layout.tp, tp_rank)


def hf_to_megatron(state: Mapping[str, torch.Tensor], config: Any, layout: MegatronLayout,
                   only: tuple[int, int] | None = None) -> Shards:
    """A transformers state dict -> megatron-core state dicts, ``[pp stage][ep rank * tp + tp rank]``
    (tensors may share storage with ``state``'s).

    ``only=(stage, rank)`` fills just that shard (the others stay empty) and looks up only the
    names it needs (``state`` may be a lazy mapping): see :func:`megatron_shard`."""
    _check(_Dims.of(config), layout)
    shards: Shards = [[{} for _ in range(layout.ep * layout.tp)] for _ in range(layout.pp)]
    for stage in range(layout.pp):
        for r in range(layout.ep * layout.tp):
            if only is None or only == (stage, r):
                shards[stage][r] = dict(megatron_shard(state_reader(state), config, layout, stage, r % layout.tp,
                                                       r // layout.tp))
    return shards


def hf_names_of(megatron_name: str, config: Any, layout: MegatronLayout, stage: int = 0) -> list[str]:
    """The transformers parameters a megatron-core parameter (of pipeline stage ``stage``) holds (an
    expert's weight, or their stack (:func:`expert_stack`): a part of the layer's fused tensor)."""
    dims = _Dims.of(config)
    norm_attn, norm_mlp = _norm_names(layout, dims)
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
    stack = expert_stack(megatron_name)
    stack_name = stack[0] if stack else megatron_name
    if _STACK.fullmatch(stack_name):
        return [f"{hf}mlp.experts.{EXPERT_HF[stack_name.rsplit('.', 2)[-2]]}"]
    names = {
        "self_attention.linear_qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"],
        "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
        "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
        "mlp.router.weight": ["mlp.gate.weight"],
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
    transformers tensors it holds (see :func:`hf_names_of`). A mixture of experts' expert weights
    convert as their stack over all experts of the layer (:func:`expert_stack`, :func:`stack_experts`:
    ``[E, ...]`` per tensor-parallel rank), which holds a whole fused transformers tensor."""
    dims = _Dims.of(config)
    names = hf_names_of(megatron_name, config, layout, stage)
    if not names:
        return {}
    if expert_stack(megatron_name) is not None:
        raise ValueError(f"{megatron_name} is one expert's part of {names[0]}: convert the stack of the layer's "
                         f"experts, {expert_stack(megatron_name)[0]} (layouts.stack_experts)")
    if _STACK.fullmatch(megatron_name):  # [E, 2I/tp, H] ([gate shard; up shard] each) or [E, H, I/tp] per rank
        if megatron_name.endswith("linear_fc1.weight"):
            halves = [t.chunk(2, dim=1) for t in tp_shards]
            return {names[0]: torch.cat([torch.cat([g for g, _ in halves], dim=1),
                                         torch.cat([u for _, u in halves], dim=1)], dim=1)}
        return {names[0]: torch.cat(tp_shards, dim=2)}
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


def stack_experts(tensors: Mapping[str, torch.Tensor], stack: str) -> torch.Tensor:
    """The local experts' weights in ``tensors`` (megatron names) that make up ``stack`` (see
    :func:`expert_stack`), stacked in local-expert order: ``[E / ep, ...]``."""
    local = {expert_stack(n): t for n, t in tensors.items() if expert_stack(n) is not None}
    return torch.stack([t for (name, _), t in sorted(local.items(), key=lambda item: item[0][1]) if name == stack])


def megatron_to_hf(shards: Shards, config: Any, layout: MegatronLayout) -> dict[str, torch.Tensor]:
    """megatron-core state dicts ``[pp stage][ep rank * tp + tp rank]`` -> a transformers state dict
    (full tensors; the experts of every expert-parallel rank stacked into the fused tensors)."""
    _check(_Dims.of(config), layout)
    tp = layout.tp
    out: dict[str, torch.Tensor] = {}
    for stage, ranks in enumerate(shards):
        stacks: dict[str, None] = {}
        for name in ranks[0]:
            if expert_stack(name) is not None:
                stacks[expert_stack(name)[0]] = None
            else:
                out.update(hf_from_megatron(name, [ranks[r][name] for r in range(tp)], config, layout, stage))
        for stack in stacks:  # per TP rank: every expert-parallel rank's experts, in order
            parts = [torch.cat([stack_experts(ranks[e * tp + r], stack) for e in range(layout.ep)]) for r in range(tp)]
            out.update(hf_from_megatron(stack, parts, config, layout, stage))
    return out

"""megatron-core models behind the transformers call signature the hooks use, so that
``policy_step`` and ``compute_step`` run unchanged on megatron-core shards.

- :func:`build_gpt`: a ``GPTModel`` (one pipeline stage, one tensor-parallel slice, a mixture of
  experts' expert-parallel share) with a transformers config's architecture
  (:func:`~rltrainer.strategies.megatron.config.megatron_config`).
- :class:`MegatronCausalLM`: ``model(input_ids, attention_mask, position_ids, logits_to_keep)``
  answered with full-vocabulary logits, and ``lm_head_log_probs`` (the response tokens' log-probs
  and entropies from the vocabulary-parallel head in chunks, no logits gathered);
  :class:`MegatronValueModel`: a critic's ``.logits [b, s, 1]``.
- :class:`StageOutput` / :class:`PipelineSlot`: how a hook's model call takes part in
  megatron-core's pipeline schedule.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch

from rltrainer.lm_head import chunked_log_probs
from rltrainer.strategies.megatron.config import megatron_config
from rltrainer.strategies.megatron.cpu import cpu_attention_spec, host_split_sizes
from rltrainer.strategies.megatron.routing import attach_routing, replaying, router_class, without_te_router_gemm


def build_gpt(hf_config: Any, tp: int, on_cpu: bool, dtype: torch.dtype, post_process: bool = True,
              pp: int = 1, pre_process: bool = True, share_embeddings: bool | None = None, ep: int = 1,
              grouped_gemm: bool = False) -> torch.nn.Module:
    """A megatron-core ``GPTModel`` (this rank's pipeline stage) with the architecture of a
    Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral transformers config, converted by
    :func:`megatron_config` (which refuses a field it cannot convert). Qwen3's q/k norms are
    replicated over tensor-parallel ranks, each of which sees only its own heads: megatron-core's
    ``finalize_model_grads`` sums their gradients over the TP group
    (``distributed/finalize_model_grads.py:353-355``, keyed on ``config.qk_layernorm`` and the
    parameter names).

    A mixture of experts gets megatron-core's ``MoELayer`` in every layer: its ``TopKRouter``, the
    ``alltoall`` token dispatcher over ``ep`` expert-parallel ranks (the ``allgather`` one refuses
    ``variable_seq_lengths``: ``transformer_config.py:1827-1832``) and ``SequentialMLP`` experts
    (``num_experts / ep`` local ``MLP`` modules, run one after another), its routers replaying and
    recording (:func:`~rltrainer.strategies.megatron.routing.router_class`). ``grouped_gemm`` (GPU
    ranks with Transformer Engine only, not run in CI): Transformer Engine's ``TEGroupedMLP``
    instead (``moe_grouped_gemm=True``, the experts spec of
    ``get_moe_module_spec(use_te=True)``: ``moe_module_specs.py:13-68``,
    ``transformer_engine_spec_provider.py:61-72``), one grouped GEMM for all local experts."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = megatron_config(hf_config)
    experts = arch.transformer.get("num_moe_experts")
    if experts:
        without_te_router_gemm()
    config = TransformerConfig(
        **arch.transformer, use_cpu_initialization=on_cpu, params_dtype=dtype, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        variable_seq_lengths=True,  # micro-batches differ in length and rows
        expert_model_parallel_size=ep, moe_grouped_gemm=bool(experts and grouped_gemm),
        moe_token_dispatcher_type="alltoall",  # the default ("allgather") refuses variable lengths
        calculate_per_token_loss=True)  # the hooks normalise by global counts: the schedule must not rescale
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                    qk_layernorm=config.qk_layernorm)
    if experts and grouped_gemm:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        spec.submodules.mlp = get_moe_module_spec(use_te=True, num_experts=experts, moe_grouped_gemm=True)
    if experts:
        spec.submodules.mlp.submodules.router = router_class()
    if on_cpu:
        spec.submodules.self_attention.submodules.core_attention = cpu_attention_spec()
    gpt_args = dict(arch.gpt) if share_embeddings is None else {
        **arch.gpt, "share_embeddings_and_output_weights": share_embeddings}
    gpt = GPTModel(config=config, transformer_layer_spec=spec, pre_process=pre_process, post_process=post_process,
                   **gpt_args)
    if on_cpu and experts:
        host_split_sizes(gpt)
    return gpt


class StageOutput(BaseException):  # noqa: N818 (not an error: a control-flow signal, like GeneratorExit)
    """Raised by a pipelined model called on a stage before the last: ``hidden`` is what the stage
    sends on, and the rest of the hook (which needs the last stage's logits) does not run. A
    ``BaseException``, so that an ``except Exception`` in a hook lets it through."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.hidden = hidden


class PipelineSlot:
    """The model megatron-core's schedule drives on this rank. The schedule hands it the tensor
    received from the previous stage (``set_input_tensor``); whichever :class:`MegatronCausalLM`
    the hook calls takes it from here. ``config`` is the policy's ``TransformerConfig``."""

    def __init__(self, config: Any) -> None:
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor


class MegatronCausalLM(torch.nn.Module):
    """A ``GPTModel`` (one pipeline stage of it) behind the transformers causal-LM call the hooks use.

    Left-padded rows are rotated so that their tokens start at position 0 (megatron's RoPE counts
    positions from the start of the sequence; the padding moves behind the causal horizon), then
    the logits are rotated back. Logits are gathered over the tensor-parallel ranks. A stage
    after the first reads its input from ``slot``; a stage before the last raises
    :class:`StageOutput` with its hidden states.
    """

    def __init__(self, gpt: torch.nn.Module, config: Any, slot: PipelineSlot | None = None) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = config
        self.slot = slot
        attach_routing(self, gpt)  # a mixture of experts: rltrainer.models.moe.recording records its routers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False, logits_to_keep: int = 0,
                routed_experts: torch.Tensor | None = None, replay_routes: bool = True, **kwargs: Any
                ) -> SimpleNamespace:
        """``routed_experts [b, s, L, K]``: a mixture of experts' routes to replay (or, with
        ``replay_routes=False``, to compare the routers' choice with; see
        :mod:`~rltrainer.strategies.megatron.routing`)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        _, _, pads = rotate_left(input_ids, attention_mask)
        out = self._stage_output(input_ids, attention_mask, routed_experts, replay_routes)  # [b, s, V/tp]
        logits = rotate_back(gather_from_tensor_model_parallel_region(out)[..., : self.config.vocab_size], pads)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)

    def _stage_output(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      routed_experts: torch.Tensor | None = None, replay_routes: bool = True) -> torch.Tensor:
        """The GPT's output ``[b, s, ...]`` on left-aligned rows (:func:`rotate_left`), its routers
        replaying ``routed_experts`` if given (:func:`~rltrainer.strategies.megatron.routing.replaying`);
        a stage before the last raises :class:`StageOutput` with its hidden states ``[s, b, H]``."""
        ids, positions, pads = rotate_left(input_ids, attention_mask)
        s = ids.shape[1]
        index = (torch.arange(s, device=ids.device)[None] + pads[:, None]) % s  # [b, s] each column's source
        if not self.gpt.pre_process:
            if self.slot is None or self.slot.input_tensor is None:
                raise RuntimeError("A pipeline stage after the first runs only inside megatron's schedule "
                                   "(MegatronWorker.run_micro_batches), which hands it the previous stage's output")
            self.gpt.set_input_tensor(self.slot.input_tensor)
        with replaying(self.gpt, routed_experts, index, attention_mask, replay_routes):
            out = self.gpt(ids, positions, attention_mask=None)
        if not self.gpt.post_process:
            raise StageOutput(out)
        return out

    def lm_head_log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          position_ids: torch.Tensor | None, targets: torch.Tensor, temperature: float = 1.0,
                          chunk_tokens: int | None = None, routed_experts: torch.Tensor | None = None,
                          replay_routes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies ``[n, T]`` of the last ``T`` tokens ``targets [n, T]`` of
        ``input_ids``, from the final hidden states and this rank's vocabulary rows of the output
        layer, in chunks (:func:`~rltrainer.lm_head.chunked_log_probs`, reduced over the
        tensor-parallel group): the full-vocabulary logits are neither built nor gathered.
        ``routed_experts [n, s, L, K]`` (aligned with ``input_ids``): a mixture of experts' routes
        to replay (routing replay, R3), or with ``replay_routes=False`` to compare the routers'
        choice with (:mod:`~rltrainer.strategies.megatron.routing`)."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        if getattr(self.gpt.config, "sequence_parallel", False):
            raise NotImplementedError("lm_head_log_probs with sequence parallelism: the hidden states are split "
                                      "over the sequence; call the model for full logits instead")
        head, captured = getattr(self.gpt, "output_layer", None), {}
        if head is None:  # a stage before the last: raises StageOutput
            return self._stage_output(input_ids, attention_mask, routed_experts, replay_routes)

        def hidden_out(input_: torch.Tensor, weight: torch.Tensor | None = None, **kwargs: Any) -> tuple:
            captured["weight"] = head.weight if weight is None else weight
            return input_, None

        _, _, pads = rotate_left(input_ids, attention_mask)
        head.forward = hidden_out  # type: ignore[method-assign]
        try:
            hidden = self._stage_output(input_ids, attention_mask, routed_experts, replay_routes)  # [n, s, H]
        finally:
            del head.forward
        n, T = targets.shape
        hidden = rotate_back(hidden, pads)[:, -T - 1:-1].reshape(n * T, -1)  # position P-1+t predicts token t
        tp = parallel_state.get_tensor_model_parallel_world_size()
        weight = captured["weight"]
        if tp > 1:
            hidden = copy_to_tensor_model_parallel_region(hidden)  # backward: sum the ranks' parts
        log_probs, entropy = chunked_log_probs(
            hidden, weight, targets.reshape(-1), temperature, chunk_tokens,
            group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
            vocab_start=parallel_state.get_tensor_model_parallel_rank() * weight.shape[0],
            vocab_size=self.config.vocab_size)
        return log_probs.view(n, T), entropy.view(n, T)


class MegatronValueModel(torch.nn.Module):
    """A critic: a ``GPTModel`` trunk (no output layer) with the transformers model's final norm
    and one-output ``score`` head (replicated on every tensor-parallel rank), answering the
    token-classification call (``.logits [b, s, 1]``)."""

    def __init__(self, gpt: torch.nn.Module, norm: torch.nn.Module, score: torch.nn.Module, config: Any,
                 dropout: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.gpt, self.norm, self.score, self.config = gpt, norm, score, config
        self.dropout = dropout or torch.nn.Identity()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs: Any) -> SimpleNamespace:
        def run(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            hidden = self.gpt(ids, positions, attention_mask=None)  # [s, b, H] without post-processing
            return self.score(self.dropout(self.norm(hidden.transpose(0, 1))))

        return SimpleNamespace(logits=left_aligned(run, input_ids, attention_mask))


def critic_trunk_config(config: Any) -> Any:
    """The config a critic's trunk is built and converted with: a ``GPTModel`` without output layer,
    as if its embedding were tied."""
    config = copy.deepcopy(config)
    config.tie_word_embeddings = True
    return config


def rotate_left(input_ids: torch.Tensor, attention_mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's tokens rotated to start at position 0 (megatron's RoPE counts from the start;
    left padding moves behind the causal horizon): ``(ids, positions, pads per row)``."""
    b, s = input_ids.shape
    steps = torch.arange(s, device=input_ids.device)
    pads = (attention_mask.cumsum(-1) == 0).sum(-1) if attention_mask is not None else torch.zeros_like(input_ids[:, 0])
    return input_ids.gather(1, (steps[None] + pads[:, None]) % s), steps.expand(b, s), pads


def rotate_back(out: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate_left` for an output ``[b, s, ...]``."""
    steps = torch.arange(out.shape[1], device=out.device)
    back = ((steps[None] - pads[:, None]) % out.shape[1])[..., None].expand(-1, -1, out.shape[-1])
    return out.gather(1, back)


def left_aligned(run: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``run(ids, positions) -> [b, s, ...]`` on left-aligned rows, its output in the input's layout."""
    ids, positions, pads = rotate_left(input_ids, attention_mask)
    return rotate_back(run(ids, positions), pads)


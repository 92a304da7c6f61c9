"""``strategy="megatron"``: training on megatron-core (written against megatron-core 0.16) with
tensor, pipeline and data parallelism; ranks are Ray actors (one in-process worker for a single rank).

Each rank builds the module's models with ``configure_model`` (transformers, Qwen2 / Llama
family), converts them to its own megatron-core ``GPTModel`` shard (its pipeline stage, its
tensor-parallel slice) with :func:`~rltrainer.strategies.megatron_weights.hf_to_megatron`, and
swaps them into the module behind :class:`MegatronCausalLM`, which answers the transformers call
the hooks make (``model(input_ids, attention_mask, position_ids, logits_to_keep)``) with
full-vocabulary logits. So ``policy_step`` and ``compute_step`` run unchanged: changing FSDP2 to
Megatron touches no algorithm. Weights leave in HF names (:func:`megatron_to_hf`), so any engine
takes them.

The hooks run inside megatron-core's forward-backward schedule (``get_forward_backward_func``:
no pipelining at ``pipeline_model_parallel_size=1``, 1F1B otherwise). On the last stage a hook
runs whole and its loss (or its outputs) is the schedule's; on an earlier stage the model call
inside the hook raises :class:`StageOutput`, whose hidden states the schedule sends on (see
:class:`PipelineSlot`). So with pipeline stages a hook may call one pipelined model per
micro-batch (PPO's critic needs ``pipeline_model_parallel_size=1``).

Gradients are summed over data-parallel ranks (losses are normalised by global counts), the tied
embedding's two copies (first and last stage) add their gradients, and clipping uses the global
norm over tensor-parallel shards and pipeline stages. On CPU (tests), the attention is a layer
spec of our own (SDPA) and megatron-core's CUDA placements point at the CPU: see
:func:`cpu_shims` and :func:`cpu_placement`.

Weights leave one bucket at a time: the stage holding a bucket's tensors gathers their
tensor-parallel shards, converts just those, and broadcasts them over its pipeline group; only
parameters an optimizer step changed are sent.
"""

from __future__ import annotations

import contextlib
import copy
import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rltrainer.strategies.distributed import TrainingWorker, WorkerGroupStrategy
from rltrainer.strategies.megatron_weights import MegatronLayout, hf_from_megatron, hf_names_of, hf_to_megatron
from rltrainer.strategies.strategy import (STRATEGIES, load_local_training_state, local_training_state,
                                          normalize_optimizers)
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.module import RLModule

SUPPORTED = ("qwen2", "llama")


def cpu_shims() -> None:
    """megatron-core places some tensors with ``torch.cuda.current_device()`` (RoPE frequencies,
    the global memory buffer, pipeline receive buffers) and synchronises after pipeline sends; in a
    CPU-only worker process, make those the CPU and a no-op."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


class _CUDAOnCPU(TorchFunctionMode):
    """Tensors that megatron-core creates with ``device="cuda"`` (the schedules' token counter) or
    moves with ``.cuda()`` (the tied embedding's copy on the last stage) stay on the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def cpu_placement(device: torch.device) -> contextlib.AbstractContextManager:
    """Around megatron-core calls: on a CPU rank, CUDA placements become CPU ones (see
    :class:`_CUDAOnCPU`); on a GPU rank, nothing."""
    return _CUDAOnCPU() if device.type == "cpu" else contextlib.nullcontext()


def cpu_attention_spec() -> type:
    """A ``core_attention`` for CPU: causal SDPA over this rank's heads (grouped queries by repetition)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import MegatronModule

    class CPUAttention(MegatronModule):
        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
            super().__init__(config=config)
            tp = parallel_state.get_tensor_model_parallel_world_size()
            self.heads, self.groups = config.num_attention_heads // tp, config.num_query_groups // tp

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Any:
            sq, b = query.shape[:2]  # [s, b, heads, d] -> [b, heads, s, d]
            q = query.permute(1, 2, 0, 3)
            k = key.permute(1, 2, 0, 3).repeat_interleave(self.heads // self.groups, dim=1)
            v = value.permute(1, 2, 0, 3).repeat_interleave(self.heads // self.groups, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(sq, b, -1)

    return CPUAttention


def build_gpt(hf_config: Any, tp: int, on_cpu: bool, dtype: torch.dtype, post_process: bool = True,
              pp: int = 1, pre_process: bool = True, share_embeddings: bool | None = None) -> torch.nn.Module:
    """A megatron-core ``GPTModel`` (this rank's pipeline stage) with the architecture of a
    Qwen2 / Llama transformers config."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if hf_config.model_type not in SUPPORTED:
        raise NotImplementedError(f"strategy='megatron' builds {', '.join(SUPPORTED)} models; got model_type="
                                  f"{hf_config.model_type!r}")
    heads = hf_config.num_attention_heads
    config = TransformerConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        ffn_hidden_size=hf_config.intermediate_size, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        use_cpu_initialization=on_cpu, params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype, variable_seq_lengths=True,  # micro-batches differ in length and rows
        moe_token_dispatcher_type="alltoall",  # no experts here; the default ("allgather") refuses variable lengths
        calculate_per_token_loss=True)  # the hooks normalise by global counts: the schedule must not rescale
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if on_cpu:
        spec.submodules.self_attention.submodules.core_attention = cpu_attention_spec()
    rope = getattr(hf_config, "rope_theta", None) or (getattr(hf_config, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=hf_config.vocab_size,
                    max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=int(rope), pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings) if share_embeddings is None
                    else share_embeddings)


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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False, logits_to_keep: int = 0,
                **kwargs: Any) -> SimpleNamespace:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        ids, positions, pads = rotate_left(input_ids, attention_mask)
        if not self.gpt.pre_process:
            if self.slot is None or self.slot.input_tensor is None:
                raise RuntimeError("A pipeline stage after the first runs only inside megatron's schedule "
                                   "(MegatronWorker.run_micro_batches), which hands it the previous stage's output")
            self.gpt.set_input_tensor(self.slot.input_tensor)
        out = self.gpt(ids, positions, attention_mask=None)  # [b, s, V/tp], or [s, b, H] before the last stage
        if not self.gpt.post_process:
            raise StageOutput(out)
        logits = rotate_back(gather_from_tensor_model_parallel_region(out)[..., : self.config.vocab_size], pads)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


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


class MegatronWorker(TrainingWorker):
    """One megatron-core rank: a pipeline stage's tensor-parallel shard of each model."""

    def __init__(self, rank: int, world_size: int, threads: int | None = None, device: str = "auto",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(rank, world_size, threads=threads, device=device, bucket_bytes=bucket_bytes)
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._sources: dict[str, tuple[int, str]] = {}  # HF name -> (stage, megatron parameter holding it)
        self.layout = MegatronLayout()
        self.stage = 0
        self._slot: PipelineSlot | None = None

    def setup(self, module: RLModule, options: dict[str, Any], seed: int) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        self.options = options
        tp, pp = options["tensor_model_parallel_size"], options["pipeline_model_parallel_size"]
        if self.device.type == "cpu":
            cpu_shims()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        self.layout, self.stage = MegatronLayout(tp=tp, pp=pp), parallel_state.get_pipeline_model_parallel_rank()
        torch.manual_seed(seed)
        if self.device.type == "cuda":  # megatron's attention forks the tensor-parallel CUDA RNG state
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        module.configure_model()
        if pp > 1 and getattr(module, "critic", None) is not None:
            raise NotImplementedError(
                f"pipeline_model_parallel_size={pp} runs one pipelined model per hook call; {type(module).__name__} "
                "trains a critic in the same policy_step (PPO): use pipeline_model_parallel_size=1")
        dtype = torch.bfloat16 if options["precision"] == "bf16-true" else torch.float32
        specs = {n: (tuple(p.shape), p.dtype) for n, p in module.policy.named_parameters()}
        with cpu_placement(self.device):
            for name, hf_model in list(module.named_children()):
                if not hasattr(hf_model, "config") or not any(True for _ in hf_model.parameters()):
                    continue
                is_critic = hasattr(hf_model, "score") and not hasattr(hf_model, "lm_head")
                if is_critic:
                    wrapped = self._critic(hf_model, dtype)
                else:
                    gpt = self._megatron_trunk(hf_model, dtype, pre_process=self.stage == 0,
                                               post_process=self.stage == pp - 1)
                    if self._slot is None:
                        self._slot = PipelineSlot(gpt.config)
                    wrapped = MegatronCausalLM(gpt, hf_model.config, self._slot)
                setattr(module, name, wrapped)  # the transformers model is dropped here
                self.models[name] = wrapped
        self.module = module
        config = module.policy.config
        own = {hf: (self.stage, name) for name, _ in module.policy.gpt.named_parameters()
               for hf in hf_names_of(name, config, self.layout, self.stage)}
        stages: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(stages, own)  # every rank learns which stage holds each HF name
        self._sources = {hf: src for part in sorted(stages, key=lambda p: min(v[0] for v in p.values()))
                         for hf, src in part.items()}
        missing = set(specs) - set(self._sources)
        if missing:
            raise RuntimeError(f"Megatron layout holds no parameter for {sorted(missing)}")
        self._specs = {n: specs[n] for n in self._sources}  # export in megatron order: siblings adjacent
        self.optimizers, self.schedulers = normalize_optimizers(module.configure_optimizers())

    def _megatron_trunk(self, hf_model: torch.nn.Module, dtype: torch.dtype, pre_process: bool = True,
                        post_process: bool = True) -> torch.nn.Module:
        """This rank's ``GPTModel`` shard with ``hf_model``'s weights (and its frozen parameters
        frozen). Only this rank's shard is converted. ``post_process=False`` on a single stage
        builds a trunk for a critic (no output layer; the final norm stays outside)."""
        from megatron.core import parallel_state

        config = hf_model.config
        tied = bool(config.tie_word_embeddings)
        state = {n: p.detach() for n, p in hf_model.named_parameters()}
        critic_trunk = not post_process and self.layout.pp == 1
        if critic_trunk:  # no output layer to fill
            config = copy.deepcopy(config)
            config.tie_word_embeddings, tied = True, False
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        shard = hf_to_megatron(state, config, self.layout, only=(self.stage, tp_rank))[self.stage][tp_rank]
        if critic_trunk:
            shard.pop("decoder.final_layernorm.weight")
        gpt = build_gpt(config, self.layout.tp, self.device.type == "cpu", dtype, post_process=post_process,
                        pp=self.layout.pp, pre_process=pre_process, share_embeddings=tied).to(self.device)
        missing, unexpected = gpt.load_state_dict(shard, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"Megatron layout mismatch: missing {missing}, unexpected {unexpected}")
        trainable = {n: p.requires_grad for n, p in hf_model.named_parameters()}
        for mname, param in gpt.named_parameters():  # frozen in transformers -> frozen here
            hf_names = hf_names_of(mname, config, self.layout, self.stage) or ["model.embed_tokens.weight"]
            param.requires_grad_(any(trainable[h] for h in hf_names))
        return gpt

    def _critic(self, hf_model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        """A token-classification critic: megatron trunk + the model's final norm and score head."""
        trunk = self._megatron_trunk(hf_model, dtype, post_process=False)
        norm, score = copy.deepcopy(hf_model.model.norm), copy.deepcopy(hf_model.score)
        return MegatronValueModel(trunk, norm.to(self.device, dtype), score.to(self.device, dtype), hf_model.config,
                                  dropout=copy.deepcopy(getattr(hf_model, "dropout", None)))

    def close(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        super().close()

    # -- compute: megatron-core's forward-backward schedule ------------------------------------------
    def run_micro_batches(self, hook: Any, micro_batches: list[RolloutBatch], backward: bool) -> list[Any]:
        """Run ``hook`` over the micro-batches inside megatron-core's schedule (1F1B across
        pipeline stages). Returns the hook's outputs on the last stage, nothing on earlier ones."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        one = torch.ones((), dtype=torch.int)

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            try:
                out = hook(next(data_iterator))
            except StageOutput as stage:
                return stage.hidden, None  # an earlier stage: the schedule sends this on
            loss = out[0] if backward else torch.zeros((), device=self.device)
            # (loss, tokens, stored): with calculate_per_token_loss the schedule neither rescales
            # the loss (the hooks normalise by global counts) nor uses the count
            return loss, lambda output: (output, one, out)

        if not micro_batches:
            return []
        with cpu_placement(self.device):
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro_batches), model=self._slot,
                num_microbatches=len(micro_batches), seq_length=max(mb["input_ids"].shape[1] for mb in micro_batches),
                micro_batch_size=max(len(mb) for mb in micro_batches), forward_only=not backward)

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float | None) -> float:
        self._reduce_tied_embedding()
        return reduce_and_clip(params, max_norm)

    def _reduce_tied_embedding(self) -> None:
        """Tied embeddings over pipeline stages: the first stage's embedding and the last stage's
        output layer are copies of one tensor; add their gradients (megatron's embedding group)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.layout.pp == 1 or not self.module.policy.config.tie_word_embeddings:
            return
        if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
            return
        grad = self.module.policy.gpt.shared_embedding_or_output_weight().grad
        if grad is not None:
            dist.all_reduce(grad, group=parallel_state.get_embedding_group())

    def mark_stepped(self, stepped: list[str]) -> None:
        """Bump the HF names each stepped megatron parameter holds (a frozen one holds no step), on
        every stage alike: each rank plans the same export."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        config = self.module.policy.config
        names = [hf for name in stepped
                 for hf in hf_names_of(name.removeprefix("gpt."), config, self.layout, self.stage)]
        if self.layout.pp > 1:
            parts: list[Any] = [None] * self.layout.pp
            dist.all_gather_object(parts, names, group=parallel_state.get_pipeline_model_parallel_group())
            names = [n for part in parts for n in part]
        self.versions.bump(names)

    # -- weights -----------------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)

    def gather_weights(self, names: list[str], dtype: torch.dtype | None, index: int) -> list[tuple[str, torch.Tensor]]:
        """The full HF tensors of ``names`` (one bucket) on every rank: the stage holding each
        megatron parameter gathers its tensor-parallel shards and converts them, then broadcasts
        the result over its pipeline group."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp = self.layout.tp
        params = dict(self.module.policy.gpt.named_parameters())
        config = self.module.policy.config
        out: dict[str, torch.Tensor] = {}
        for stage, source in dict.fromkeys(self._sources[n] for n in names):  # each source once, in order
            full: dict[str, torch.Tensor] = {}
            if stage == self.stage:
                local = params[source].detach().contiguous()
                parts = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(parts, local, group=tp_group)
                full = hf_from_megatron(source, parts, config, self.layout, stage)
            for name in (n for n in names if self._sources[n] == (stage, source)):
                shape, own_dtype = self._specs[name]
                if name in full:
                    tensor = full[name].to(dtype or own_dtype).contiguous()
                else:
                    tensor = torch.empty(shape, dtype=dtype or own_dtype, device=self.device)
                if self.layout.pp > 1:
                    group = parallel_state.get_pipeline_model_parallel_group()
                    dist.broadcast(tensor, src=dist.get_global_rank(group, stage), group=group)
                out[name] = tensor
        return [(n, out[n]) for n in names]

    # -- checkpoints: each rank keeps its own shard -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return local_training_state(self.module, self.optimizers, self.schedulers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_local_training_state(self.module, self.optimizers, self.schedulers, state)
        self.versions.forget_synced()


def reduce_and_clip(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Sum gradients over data-parallel ranks, then clip by the global norm: tensor-parallel
    shards add their squares across the TP group, replicated tensors count once per stage, stages
    add up over the pipeline group, and the last stage's copy of a tied embedding is not counted."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    grads = [p.grad for p in params if p.grad is not None]
    if parallel_state.get_data_parallel_world_size() > 1:
        for g in grads:
            dist.all_reduce(g, group=parallel_state.get_data_parallel_group())
    counted = [p for p in params if p.grad is not None and not getattr(p, "shared", False)]
    sharded = torch.as_tensor(sum((p.grad.float() ** 2).sum() for p in counted
                                  if getattr(p, "tensor_model_parallel", False)), dtype=torch.float32)
    replicated = torch.as_tensor(sum((p.grad.float() ** 2).sum() for p in counted
                                     if not getattr(p, "tensor_model_parallel", False)), dtype=torch.float32)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
    total = sharded + replicated
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    norm = math.sqrt(float(total))
    if max_norm and math.isfinite(norm) and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


@STRATEGIES.register("megatron", description="megatron-core: tensor x pipeline x data parallel (Ray workers)")
class MegatronStrategy(WorkerGroupStrategy):
    """megatron-core training on ``devices x num_nodes`` ranks: ``tensor_model_parallel_size``
    ranks split each layer's matrices, ``pipeline_model_parallel_size`` stages split the layers,
    and the rest is data parallel. Ranks are ordered as megatron-core orders them: tensor-parallel
    first, then data-parallel, then pipeline stages.

    Args:
        tensor_model_parallel_size: ranks that split each layer's matrices.
        pipeline_model_parallel_size: stages the decoder layers are split into (evenly); the hooks
            run in megatron-core's 1F1B schedule.
        devices / num_nodes / rollout_placement / ...: as for :class:`FSDP2Strategy`.
    """

    name = "megatron"
    worker_cls = MegatronWorker

    def __init__(self, devices: int | str = 1, num_nodes: int = 1, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1, **kwargs: Any) -> None:
        super().__init__(devices=devices, num_nodes=num_nodes, **kwargs)
        tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
        if not isinstance(tp, int) or not isinstance(pp, int) or tp < 1 or pp < 1 or self.world_size % (tp * pp):
            raise ValueError(f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} must divide the "
                             f"{self.world_size} ranks (devices x num_nodes)")
        if self.precision in ("bf16-mixed", "16-mixed"):
            raise ValueError(f"strategy='megatron' takes precision '32-true' or 'bf16-true', got {self.precision!r}")
        self.tp, self.pp = tp, pp
        self.options.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)

    def data_parallel_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def reports(self, rank: int) -> bool:
        return rank // (self.tp * self.data_parallel_size) == self.pp - 1  # the last pipeline stage

    def _training_state(self) -> Any:
        return {"ranks": self._require_group().execute_all("state_dict"), "tensor_model_parallel_size": self.tp,
                "pipeline_model_parallel_size": self.pp}

    def _load_training_state(self, state: Any) -> None:
        have = (len(state["ranks"]), state.get("tensor_model_parallel_size"),
                state.get("pipeline_model_parallel_size", 1))
        if have != (self.world_size, self.tp, self.pp):
            raise ValueError(f"This checkpoint has {have[0]} ranks with tensor_model_parallel_size={have[1]}, "
                             f"pipeline_model_parallel_size={have[2]}; this run has {self.world_size} with {self.tp}, "
                             f"{self.pp}")
        self._require_group().dispatch("load_state_dict", [((s,), {}) for s in state["ranks"]])

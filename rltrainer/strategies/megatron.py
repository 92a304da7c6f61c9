"""``strategy="megatron"``: training on megatron-core (written against megatron-core 0.16) with
tensor and data parallelism; ranks are Ray actors (one in-process worker for a single rank).

Each rank builds the module's models with ``configure_model`` (transformers, Qwen2 / Llama
family), converts them to megatron-core ``GPTModel`` shards with
:func:`~rltrainer.strategies.megatron_weights.hf_to_megatron`, and swaps them into the module
behind :class:`MegatronCausalLM`, which answers the transformers call the hooks make
(``model(input_ids, attention_mask, position_ids, logits_to_keep)``) with full-vocabulary logits.
So ``policy_step`` and ``compute_step`` run unchanged: changing FSDP2 to Megatron touches no
algorithm. Weights leave in HF names (:func:`megatron_to_hf`), so any engine takes them.

Gradients are summed over data-parallel ranks (losses are normalised by global counts) and clipped
by the global norm over tensor-parallel shards. On CPU (tests), the attention is a layer spec of
our own (SDPA) and megatron-core's ``torch.cuda.current_device()`` placements point at the CPU:
see :func:`cpu_shims`.

Weights leave one bucket at a time: each bucket gathers the tensor-parallel shards of the
megatron parameters behind its HF names and converts just those; only parameters an optimizer
step changed are sent.

``policy_step`` runs in this module's micro-batch loop, not megatron-core's
``forward_backward_no_pipelining``: that allocates ``torch.zeros(..., device="cuda")`` and cannot
run on CPU, where this strategy is tested. Not yet: pipeline parallelism (``hf_to_megatron`` lays
out stages; no pipeline schedule runs them).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rltrainer.strategies.distributed import TrainingWorker, WorkerGroupStrategy
from rltrainer.strategies.megatron_weights import MegatronLayout, hf_from_megatron, hf_names_of, hf_to_megatron
from rltrainer.strategies.strategy import (STRATEGIES, load_local_training_state, local_training_state,
                                          normalize_optimizers)
from rltrainer.strategies.weights import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from rltrainer.module import RLModule

SUPPORTED = ("qwen2", "llama")


def cpu_shims() -> None:
    """megatron-core places some tensors with ``torch.cuda.current_device()`` (RoPE frequencies,
    the global memory buffer); in a CPU-only worker process, make that the CPU."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


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


def build_gpt(hf_config: Any, tp: int, on_cpu: bool, dtype: torch.dtype, post_process: bool = True) -> torch.nn.Module:
    """A megatron-core ``GPTModel`` with the architecture of a Qwen2 / Llama transformers config."""
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
        tensor_model_parallel_size=tp, bf16=dtype == torch.bfloat16)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if on_cpu:
        spec.submodules.self_attention.submodules.core_attention = cpu_attention_spec()
    rope = getattr(hf_config, "rope_theta", None) or (getattr(hf_config, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=hf_config.vocab_size,
                    max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=int(rope), post_process=post_process,
                    share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings) and post_process)


class MegatronCausalLM(torch.nn.Module):
    """A ``GPTModel`` behind the transformers causal-LM call the hooks use.

    Left-padded rows are rotated so that their tokens start at position 0 (megatron's RoPE counts
    positions from the start of the sequence; the padding moves behind the causal horizon), then
    the logits are rotated back. Logits are gathered over the tensor-parallel ranks.
    """

    def __init__(self, gpt: torch.nn.Module, config: Any) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False, logits_to_keep: int = 0,
                **kwargs: Any) -> SimpleNamespace:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        def run(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            logits = self.gpt(ids, positions, attention_mask=None)  # [b, s, V/tp]
            return gather_from_tensor_model_parallel_region(logits)[..., : self.config.vocab_size]

        logits = left_aligned(run, input_ids, attention_mask)
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


def left_aligned(run: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``run(ids, positions) -> [b, s, ...]`` with each row's tokens rotated to start at position 0
    (megatron's RoPE counts from the start; left padding moves behind the causal horizon), and its
    output rotated back to the input's layout."""
    b, s = input_ids.shape
    steps = torch.arange(s, device=input_ids.device)
    pads = (attention_mask.cumsum(-1) == 0).sum(-1) if attention_mask is not None else torch.zeros_like(input_ids[:, 0])
    out = run(input_ids.gather(1, (steps[None] + pads[:, None]) % s), steps.expand(b, s))
    back = ((steps[None] - pads[:, None]) % s)[..., None].expand(-1, -1, out.shape[-1])
    return out.gather(1, back)


class MegatronWorker(TrainingWorker):
    """One megatron-core rank: a tensor-parallel shard of each model."""

    def __init__(self, rank: int, world_size: int, threads: int | None = None, device: str = "auto",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(rank, world_size, threads=threads, device=device, bucket_bytes=bucket_bytes)
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._sources: dict[str, str] = {}  # HF name -> the megatron parameter holding it

    def setup(self, module: RLModule, options: dict[str, Any], seed: int) -> None:
        from megatron.core import parallel_state

        self.options = options
        tp = options["tensor_model_parallel_size"]
        on_cpu = self.device.type == "cpu"
        if on_cpu:
            cpu_shims()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        torch.manual_seed(seed)
        module.configure_model()
        dtype = torch.bfloat16 if options["precision"] == "bf16-true" else torch.float32
        self._specs = {n: (tuple(p.shape), p.dtype) for n, p in module.policy.named_parameters()}
        for name, hf_model in list(module.named_children()):
            if not hasattr(hf_model, "config") or not any(True for _ in hf_model.parameters()):
                continue
            is_critic = hasattr(hf_model, "score") and not hasattr(hf_model, "lm_head")
            wrapped = (self._critic(hf_model, tp, on_cpu, dtype) if is_critic
                       else MegatronCausalLM(self._megatron_trunk(hf_model, tp, on_cpu, dtype, True), hf_model.config))
            setattr(module, name, wrapped)
            self.models[name] = wrapped
        self.module = module
        layout = MegatronLayout(tp=tp)
        self._sources = {hf: name for name, _ in module.policy.gpt.named_parameters()
                         for hf in hf_names_of(name, module.policy.config, layout)}
        self._specs = {n: self._specs[n] for n in self._sources}  # export in megatron order: siblings adjacent
        self.optimizers, self.schedulers = normalize_optimizers(module.configure_optimizers())

    def _megatron_trunk(self, hf_model: torch.nn.Module, tp: int, on_cpu: bool, dtype: torch.dtype,
                        post_process: bool) -> torch.nn.Module:
        """This rank's ``GPTModel`` shard with ``hf_model``'s weights (and its frozen parameters frozen)."""
        from megatron.core import parallel_state

        config = hf_model.config
        state = {n: p.detach() for n, p in hf_model.named_parameters()}
        if not post_process:  # a trunk: no output layer to fill, the final norm stays outside
            config = copy.deepcopy(config)
            config.tie_word_embeddings = True
        layout = MegatronLayout(tp=tp)
        shard = hf_to_megatron(state, config, layout)[0][parallel_state.get_tensor_model_parallel_rank()]
        if not post_process:
            shard.pop("decoder.final_layernorm.weight")
        gpt = build_gpt(config, tp, on_cpu, dtype, post_process=post_process).to(self.device)
        missing, unexpected = gpt.load_state_dict(shard, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"Megatron layout mismatch: missing {missing}, unexpected {unexpected}")
        trainable = {n: p.requires_grad for n, p in hf_model.named_parameters()}
        for mname, param in gpt.named_parameters():  # frozen in transformers -> frozen here
            hf_names = hf_names_of(mname, config, layout) or ["model.embed_tokens.weight"]
            param.requires_grad_(any(trainable[h] for h in hf_names))
        return gpt

    def _critic(self, hf_model: torch.nn.Module, tp: int, on_cpu: bool, dtype: torch.dtype) -> torch.nn.Module:
        """A token-classification critic: megatron trunk + the model's final norm and score head."""
        trunk = self._megatron_trunk(hf_model, tp, on_cpu, dtype, post_process=False)
        norm, score = copy.deepcopy(hf_model.model.norm), copy.deepcopy(hf_model.score)
        return MegatronValueModel(trunk, norm.to(self.device, dtype), score.to(self.device, dtype), hf_model.config,
                                  dropout=copy.deepcopy(getattr(hf_model, "dropout", None)))

    def close(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        super().close()

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float | None) -> float:
        return reduce_and_clip(params, max_norm)

    def mark_stepped(self, stepped: list[str]) -> None:
        """Bump the HF names each stepped megatron parameter holds (a frozen one holds no step)."""
        config, layout = self.module.policy.config, MegatronLayout(tp=self.options["tensor_model_parallel_size"])
        self.versions.bump(hf for name in stepped for hf in hf_names_of(name.removeprefix("gpt."), config, layout))

    # -- weights -----------------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)

    def gather_weights(self, names: list[str], dtype: torch.dtype | None, index: int) -> list[tuple[str, torch.Tensor]]:
        """Gather the tensor-parallel shards of the megatron parameters behind ``names`` (one
        bucket) and convert them to full HF tensors."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        params = dict(self.module.policy.gpt.named_parameters())
        full: dict[str, torch.Tensor] = {}
        for source in dict.fromkeys(self._sources[n] for n in names):  # each source once, in order
            local = params[source].detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local, group=group)
            full.update(hf_from_megatron(source, parts, self.module.policy.config, MegatronLayout(tp=tp)))
        return [(n, full[n].to(dtype) if dtype else full[n]) for n in names]

    # -- checkpoints: each rank keeps its own shard -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return local_training_state(self.module, self.optimizers, self.schedulers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_local_training_state(self.module, self.optimizers, self.schedulers, state)
        self.versions.forget_synced()


def reduce_and_clip(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Sum gradients over data-parallel ranks, then clip by the global norm: tensor-parallel
    shards add their squares across the TP group, replicated tensors count once."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    grads = [p.grad for p in params if p.grad is not None]
    if parallel_state.get_data_parallel_world_size() > 1:
        for g in grads:
            dist.all_reduce(g, group=parallel_state.get_data_parallel_group())
    sharded = sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None and getattr(
        p, "tensor_model_parallel", False))
    replicated = sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None and not getattr(
        p, "tensor_model_parallel", False))
    sharded = torch.as_tensor(sharded, dtype=torch.float32)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
    norm = math.sqrt(float(sharded) + float(replicated))
    if max_norm and math.isfinite(norm) and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


@STRATEGIES.register("megatron", description="megatron-core: tensor x data parallel (Ray workers)")
class MegatronStrategy(WorkerGroupStrategy):
    """megatron-core training on ``devices x num_nodes`` ranks: ``tensor_model_parallel_size``
    ranks per model replica, the rest data parallel.

    Args:
        tensor_model_parallel_size: ranks that split each layer's matrices.
        pipeline_model_parallel_size: must be 1 for now (see the module docstring).
        devices / num_nodes / rollout_placement / ...: as for :class:`FSDP2Strategy`.
    """

    name = "megatron"
    worker_cls = MegatronWorker

    def __init__(self, devices: int | str = 1, num_nodes: int = 1, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1, **kwargs: Any) -> None:
        super().__init__(devices=devices, num_nodes=num_nodes, **kwargs)
        if pipeline_model_parallel_size != 1:
            raise NotImplementedError("strategy='megatron' runs pipeline_model_parallel_size=1 for now: the weight "
                                      "layouts handle stages (megatron_weights), the pipeline schedule is not wired")
        if tensor_model_parallel_size < 1 or self.world_size % tensor_model_parallel_size:
            raise ValueError(f"tensor_model_parallel_size={tensor_model_parallel_size} must divide the "
                             f"{self.world_size} ranks (devices x num_nodes)")
        if self.precision in ("bf16-mixed", "16-mixed"):
            raise ValueError(f"strategy='megatron' takes precision '32-true' or 'bf16-true', got {self.precision!r}")
        self.tp = tensor_model_parallel_size
        self.options["tensor_model_parallel_size"] = tensor_model_parallel_size

    def data_parallel_rank(self, rank: int) -> int:
        return rank // self.tp  # megatron-core orders ranks tensor-parallel first

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tp

    def _training_state(self) -> Any:
        return {"ranks": self._require_group().execute_all("state_dict"), "tensor_model_parallel_size": self.tp}

    def _load_training_state(self, state: Any) -> None:
        if state.get("tensor_model_parallel_size") != self.tp or len(state["ranks"]) != self.world_size:
            raise ValueError(f"This checkpoint has {len(state['ranks'])} ranks with tensor_model_parallel_size="
                             f"{state.get('tensor_model_parallel_size')}; this run has {self.world_size} with {self.tp}")
        self._require_group().dispatch("load_state_dict", [((s,), {}) for s in state["ranks"]])

"""The rank side of ``strategy="megatron"``: :class:`MegatronWorker`, one megatron-core rank
(a pipeline stage's tensor-parallel shard of each model). Its gradients and optimizer step are
megatron-core's own (:mod:`~rltrainer.strategies.megatron.optimizer`): the trainable models in
megatron's ``DistributedDataParallel``, stepped by megatron's (by default distributed) optimizer.

Setup builds the transformers models on the meta device and fills each rank's shard one tensor
at a time (:meth:`MegatronWorker.setup`): read from the safetensors files (its stage, its rows),
or received from rank 0 for a random init. A rank holds its shard plus, while loading, about one
tensor: a column-split one read whole, or, on CPU, the full tensor megatron-core's own init
(``use_cpu_initialization``) draws before keeping its part, as it did before. Rank 0 of a random
init holds the whole init as well. :meth:`MegatronWorker.load_report` says what each rank holds
and read."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.models import (RandomInit, SafetensorsWeights, deferred_init, parameter_aliases, share_rng_state,
                              source_key, take_weight_source)
from rltrainer.models.support import check_causal_lm
from rltrainer.process_groups import host_group
from rltrainer.strategies.megatron import checkpoint
from rltrainer.strategies.megatron.config import MOE_MODEL_TYPES, is_moe, megatron_config
from rltrainer.strategies.megatron.cpu import cpu_placement, cpu_shims
from rltrainer.strategies.megatron.layouts import (MegatronLayout, Reader, Rows, expert_stack, hf_from_megatron,
                                                   hf_names_of, megatron_shard, stack_experts, state_reader)
from rltrainer.strategies.megatron.models import (
    MegatronCausalLM,
    MegatronValueModel,
    PipelineSlot,
    StageOutput,
    build_gpt,
    critic_trunk_config,
)
from rltrainer.strategies.megatron.optimizer import MegatronOptimizer
from rltrainer.strategies.rank_worker import TrainingWorker
from rltrainer.strategies.strategy import (
    load_local_training_state,
    local_training_state,
    normalize_optimizers,
)
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.module import RLModule

log = logging.getLogger(__name__)


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
        self._coords: list[tuple[int, int, int]] = [(0, 0, 0)]  # every rank's (pipeline stage, TP rank, EP rank)
        self.loaded: dict[str, dict[str, Any]] = {}
        self._hf_shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # each model's HF tensors (checkpoints)
        self._optimizer: MegatronOptimizer | None = None

    def setup(self, module: RLModule, options: dict[str, Any], seed: int) -> None:
        """``configure_model`` with the same seed on every rank, inside
        :func:`~rltrainer.models.deferred_init`: models built with ``build_causal_lm`` (and PPO's
        critic from a config) stay on the meta device, so no rank holds a whole transformers model.
        Each rank builds its ``GPTModel`` shard and fills it (:meth:`_load`): from the checkpoint's
        safetensors files, reading only its stage's tensors and its tensor-parallel rows
        (:func:`~rltrainer.strategies.megatron.layouts.megatron_shard`), or, for a random init,
        from rank 0, which alone runs it (with the draws every rank made before, so the same seed
        gives the same weights and, shared after it, the same RNG state) and sends each rank its
        shard one tensor at a time. A model built in full (a callable spec) is converted as it is."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        self.options = options
        tp, pp = options["tensor_model_parallel_size"], options["pipeline_model_parallel_size"]
        ep, grouped = options.get("expert_model_parallel_size", 1), options.get("moe_grouped_gemm", False)
        torch.manual_seed(seed)
        with deferred_init(init_random_here=self.rank == 0):
            module.configure_model()
        check_architectures(module, pp, tp, ep)  # every rank refuses alike, before megatron-core is set up
        if grouped:
            check_grouped_gemm(self.device)
        if pp > 1 and getattr(module, "critic", None) is not None:
            raise NotImplementedError(
                f"pipeline_model_parallel_size={pp} runs one pipelined model per hook call; {type(module).__name__} "
                "trains a critic in the same policy_step (PPO): use pipeline_model_parallel_size=1")
        if self.device.type == "cpu":
            cpu_shims()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep)
        self.layout = MegatronLayout(tp=tp, pp=pp, ep=ep, grouped_experts=grouped)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self._coords = [(0, 0, 0)] * self.world_size
        dist.all_gather_object(self._coords, (self.stage, parallel_state.get_tensor_model_parallel_rank(),
                                              parallel_state.get_expert_model_parallel_rank()), group=host_group())
        if self.device.type == "cuda":  # megatron's attention forks the tensor-parallel CUDA RNG state
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)  # CUDA generators only: configure_model's draws are unchanged
        hf_models = {name: m for name, m in module.named_children()
                     if hasattr(m, "config") and any(True for _ in m.parameters())}
        sources = {name: take_weight_source(m) for name, m in hf_models.items()}
        if self.world_size > 1 and any(isinstance(s, RandomInit) for s in sources.values()):
            share_rng_state()  # as if every rank had drawn the init
        reads = {name: self._reads(name, m, sources[name]) for name, m in hf_models.items()}  # raises before loading
        del sources  # a random init's full state goes with the readers, once every model is loaded
        specs = {n: (tuple(p.shape), p.dtype) for n, p in module.policy.named_parameters()}
        # GPTModel draws an init that the loaded weights replace: the RNG state after setup is
        # configure_model's, as on the other strategies (the same seed, the same rollouts)
        cuda = [self.device] if self.device.type == "cuda" else []
        with cpu_placement(self.device), torch.random.fork_rng(devices=cuda):
            for name, hf_model in hf_models.items():
                wrapped = self._convert(name, hf_model, reads.pop(name), options["precision"])
                setattr(module, name, wrapped)  # the transformers model (on meta, or whole if built so) goes here
                self.models[name] = wrapped
        self._report()
        self.module = module
        self._locate_weights(specs)
        self.optimizers, self.schedulers = normalize_optimizers(module.configure_optimizers())
        self._use_megatron_optimizer()

    def _locate_weights(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Every rank learns which stage (and megatron parameter) holds each of the policy's HF
        names (``specs``: their shapes and dtypes), in export order."""
        import torch.distributed as dist

        config = self.module.policy.config
        own = {hf: (self.stage, _export_source(name)) for name, _ in self.module.policy.gpt.named_parameters()
               for hf in hf_names_of(name, config, self.layout, self.stage)}
        stages: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(stages, own, group=host_group())
        self._sources = {hf: src for part in sorted(stages, key=lambda p: min(v[0] for v in p.values()))
                         for hf, src in part.items()}
        missing = set(specs) - set(self._sources)
        if missing:
            raise RuntimeError(f"Megatron layout holds no parameter for {sorted(missing)}")
        self._specs = {n: specs[n] for n in self._sources}  # export in megatron order: siblings adjacent

    def _use_megatron_optimizer(self) -> None:
        """Wrap the trainable models in megatron's DDP and step them with megatron's optimizer,
        built from the module's (see :class:`MegatronOptimizer`); the schedule's gradient hooks go
        on the config it reads (the pipeline slot's)."""
        trainable = {n: m for n, m in self.module.trainable_models().items()
                     if any(p.requires_grad for p in m.parameters())}
        self._optimizer = MegatronOptimizer(trainable, self.optimizers, self.schedulers, self.options, self.device)
        self._optimizer.attach(self._slot.config)
        self.optimizers = [self._optimizer]  # type: ignore[list-item]  # what run_train_step steps

    def _convert(self, name: str, hf_model: torch.nn.Module, reads: HFReads, precision: str) -> torch.nn.Module:
        """This rank's megatron-core model for ``hf_model`` (a causal LM, or a token-classification
        critic), filled from ``reads``; records what :meth:`load_report` shows."""
        dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
        if hasattr(hf_model, "score") and not hasattr(hf_model, "lm_head"):
            wrapped = self._critic(hf_model, reads, dtype)
        else:
            gpt = self._megatron_trunk(hf_model, reads, dtype, pre_process=self.stage == 0,
                                       post_process=self.stage == self.layout.pp - 1)
            if self._slot is None:
                self._slot = PipelineSlot(gpt.config)
            wrapped = MegatronCausalLM(gpt, hf_model.config, self._slot)
        self._hf_shapes[name] = {n: tuple(p.shape) for n, p in hf_model.named_parameters()}
        self.loaded[name] = {"source": reads.source, "full_bytes": _nbytes(hf_model.parameters()),
                             "shard_bytes": _nbytes(wrapped.parameters()), "loaded_bytes": reads.loaded}
        return wrapped

    def _reads(self, name: str, model: torch.nn.Module, source: SafetensorsWeights | RandomInit | None) -> HFReads:
        """Where this rank reads ``model``'s transformers tensors from, every one checked against
        the source first (present, same shape): a bad checkpoint raises here, naming the tensor,
        before anything is read or sent. A random init is checked on rank 0 and every rank raises."""
        import torch.distributed as dist

        params = {n: p.detach() for n, p in model.named_parameters()}
        if not any(p.is_meta for p in params.values()):
            return HFReads(state_reader(params), params, "built in full")
        if source is None:
            raise RuntimeError(
                f"{name} has parameters on the meta device but no weights to load: build it with "
                "rltrainer.models.build_causal_lm (a hub id, a path or a config) and assign it directly in "
                "configure_model, or build it in full.")
        from_rank_zero = isinstance(source, RandomInit) and self.world_size > 1
        aliases, keys, error = parameter_aliases(model), {}, None
        if not from_rank_zero or self.rank == 0:
            try:
                keys = {n: source_key(source, aliases[n], tuple(p.shape)) for n, p in params.items() if p.is_meta}
            except (KeyError, ValueError) as e:
                error = str(e.args[0])
        if from_rank_zero:
            shared = [error]
            dist.broadcast_object_list(shared, src=0, group=host_group())  # every rank raises, none waits
            error = shared[0]
        if error:
            raise ValueError(f"Cannot load {name}: {error}")
        label = "random init on rank 0" if isinstance(source, RandomInit) else f"safetensors files in {source.path}"
        if from_rank_zero and self.rank != 0:
            return HFReads(None, params, label)

        def read(hf: str, rows: Rows) -> torch.Tensor:
            if not params[hf].is_meta:  # set in full by configure_model
                return state_reader(params)(hf, rows)
            return source.read(keys[hf]) if rows is None else source.read(keys[hf], *rows)

        return HFReads(read, params, label, from_rank_zero)

    def _megatron_trunk(self, hf_model: torch.nn.Module, reads: HFReads, dtype: torch.dtype,
                        pre_process: bool = True, post_process: bool = True) -> torch.nn.Module:
        """This rank's ``GPTModel`` shard with ``hf_model``'s weights (and its frozen parameters
        frozen). Only this rank's shard is read. ``post_process=False`` on a single stage builds a
        trunk for a critic (no output layer; the final norm stays outside)."""
        config = hf_model.config
        tied = bool(config.tie_word_embeddings)
        critic_trunk = not post_process and self.layout.pp == 1
        if critic_trunk:  # no output layer to fill
            config, tied = critic_trunk_config(config), False
        gpt = build_gpt(config, self.layout.tp, self.device.type == "cpu", dtype, post_process=post_process,
                        pp=self.layout.pp, pre_process=pre_process, share_embeddings=tied,
                        ep=self.layout.ep if is_moe(config) else 1,
                        grouped_gemm=self.layout.grouped_experts).to(self.device)
        self._load(gpt, reads, config, skip={"decoder.final_layernorm.weight"} if critic_trunk else set())
        trainable = {n: p.requires_grad for n, p in hf_model.named_parameters()}
        for mname, param in gpt.named_parameters():  # frozen in transformers -> frozen here
            hf_names = hf_names_of(mname, config, self.layout, self.stage) or ["model.embed_tokens.weight"]
            param.requires_grad_(any(trainable[h] for h in hf_names))
        return gpt

    def _load(self, gpt: torch.nn.Module, reads: HFReads, config: Any, skip: set[str]) -> None:
        """Fill ``gpt`` with this rank's shard, one tensor at a time: read it, or (a random init)
        receive it from rank 0, which reads every other rank's shard in turn and sends it."""
        import torch.distributed as dist

        def shard(read: Reader, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
            stage, tp_rank, ep_rank = self._coords[rank]
            return ((n, t) for n, t in megatron_shard(read, config, self.layout, stage, tp_rank, ep_rank)
                    if n not in skip)

        if reads.read is None:  # receive: the same tensors in the same order, shaped from the meta model
            _fill(gpt, ((n, reads.receive(like, self.device)) for n, like in shard(reads.shapes, self.rank)))
            return
        _fill(gpt, shard(reads, self.rank))
        if reads.from_rank_zero:
            for rank in range(1, self.world_size):
                for _, tensor in shard(reads.read, rank):
                    dist.send(tensor.to(self.device).contiguous(), rank)

    def _critic(self, hf_model: torch.nn.Module, reads: HFReads, dtype: torch.dtype) -> torch.nn.Module:
        """A token-classification critic: megatron trunk + the model's final norm and score head
        (replicated: read whole, or broadcast from rank 0)."""
        trunk = self._megatron_trunk(hf_model, reads, dtype, post_process=False)
        norm = self._replicated(hf_model.model.norm, "model.norm.", reads).to(dtype)
        score = self._replicated(hf_model.score, "score.", reads).to(dtype)
        return MegatronValueModel(trunk, norm, score, hf_model.config,
                                  dropout=copy.deepcopy(getattr(hf_model, "dropout", None)))

    def _replicated(self, module: torch.nn.Module, prefix: str, reads: HFReads) -> torch.nn.Module:
        """A copy of a small transformers submodule on this device, its parameters (``prefix`` +
        name) read, or broadcast from rank 0 for a random init."""
        import torch.distributed as dist

        module = copy.deepcopy(module).to_empty(device=self.device)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if reads.read is not None:
                    param.copy_(reads(prefix + name, None))
                if reads.from_rank_zero or reads.read is None:
                    dist.broadcast(param, src=0)
                if reads.read is None:
                    reads.loaded += param.numel() * param.element_size()
        return module

    def load_report(self) -> dict[str, dict[str, Any]]:
        """Per model: where its weights came from (``source``), the bytes of the whole transformers
        model (``full_bytes``), of this rank's megatron shard (``shard_bytes``), and what this rank
        read from a checkpoint or received from rank 0 while loading (``loaded_bytes``: its shard,
        plus the other ranks' columns of ``o_proj`` / ``down_proj``, which it reads whole)."""
        return self.loaded

    def _report(self) -> None:
        if self.rank == 0:
            for name, r in self.loaded.items():
                log.info("%s: %s, rank 0 holds %.3g of %.3g GB (%.3g GB read or received)", name, r["source"],
                         r["shard_bytes"] / 1e9, r["full_bytes"] / 1e9, r["loaded_bytes"] / 1e9)

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

    def training_layout(self) -> dict[str, Any]:
        """What trains on this rank: each DDP-wrapped model's wrapper class, and the classes of
        megatron-core's optimizers (inside its ``ChainedOptimizer``), as ``module.QualName``."""
        def name(obj: Any) -> str:
            return f"{type(obj).__module__}.{type(obj).__qualname__}"

        return {"ddp": {n: name(d) for n, d in self._optimizer.ddps.items()},
                "optimizers": [name(o) for o in self._optimizer.megatron.chained_optimizers]}

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float | None) -> float:
        """megatron's global gradient norm and clipping (the gradients were reduced inside the
        schedule, by megatron's ``finalize_model_grads``)."""
        return self._optimizer.clip(max_norm)

    def mark_stepped(self, stepped: list[str]) -> None:
        """Bump the HF names each stepped megatron parameter holds (a frozen one holds no step), on
        every stage alike: each rank plans the same export. With megatron's DDP the gradients live
        in its buffers (``param.grad`` stays ``None``), so ``stepped`` is taken from the optimizer:
        every trainable policy parameter once it stepped, none if the step was skipped."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        policy = self.module.policy.named_parameters()
        stepped = [n for n, p in policy if p.requires_grad] if self._optimizer.stepped else []
        config = self.module.policy.config
        names = list(dict.fromkeys(hf for name in stepped  # each expert's weight is part of its layer's fused tensor
                                   for hf in hf_names_of(name.removeprefix("gpt."), config, self.layout, self.stage)))
        if self.layout.pp > 1:  # every stage's names, in stage order, from the ranks of this pipeline
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, names, group=host_group())
            pipeline = parallel_state.get_pipeline_model_parallel_group()
            names = [n for stage in range(self.layout.pp) for n in parts[dist.get_global_rank(pipeline, stage)]]
        self.versions.bump(names)

    # -- weights -----------------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)

    def gather_weights(self, names: list[str], dtype: torch.dtype | None, index: int) -> list[tuple[str, torch.Tensor]]:
        """The full HF tensors of ``names`` (one bucket) on every rank: the stage holding each
        megatron parameter gathers its tensor-parallel shards and converts them, then broadcasts
        the result over its pipeline group. A mixture of experts' fused expert tensor is the stack
        of the layer's local experts, gathered over the expert-parallel group first."""
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
                if source in params:
                    local = params[source].detach().contiguous()
                else:  # a stack of experts: [E / ep, ...] here, [E, ...] over the expert-parallel group
                    local = checkpoint.gather_experts(stack_experts({n: p.detach() for n, p in params.items()}, source))
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

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return local_training_state(self.module, self.optimizers, self.schedulers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_local_training_state(self.module, self.optimizers, self.schedulers, state)
        self.versions.forget_synced()

    def save_checkpoint(self, directory: str, async_save: bool = False) -> None:
        """This rank's part of a checkpoint any layout loads (a collective; written at once, also
        with ``async_save``): whole tensors under HF names, see
        :mod:`~rltrainer.strategies.megatron.checkpoint`."""
        checkpoint.save(Path(directory), self._checkpoint_models(), self._optimizer, self.schedulers, self.rank,
                        self.bucket_bytes)

    def checkpoint_files(self, directory: str) -> list[str]:
        """This rank's ``rank=<r>-<k>.safetensors``, and on rank 0 the ``state.pt``."""
        own = sorted(p.name for p in Path(directory).glob(f"rank={self.rank}-*.safetensors"))
        return own + [checkpoint.STATE_FILE] * (self.rank == 0)

    def load_checkpoint(self, directory: str, optimizer: bool = True) -> None:
        """Fill this rank's shards and optimizer state (without ``optimizer``: a fresh optimizer
        on the loaded weights) from a checkpoint saved with any tensor, pipeline and data-parallel sizes."""
        models = self._checkpoint_models()
        checkpoint.load(Path(directory), models, {n: self._hf_shapes[n] for n in models}, self._optimizer,
                        self.schedulers, optimizer_state=optimizer)
        self.versions.forget_synced()

    def _checkpoint_models(self) -> dict[str, Any]:
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        return {name: checkpoint.ModelTensors(model, self.layout, self.stage, tp_rank, ep_rank)
                for name, model in self.module.trainable_models().items()}


def check_architectures(module: RLModule, pp: int = 1, tp: int = 1, ep: int = 1) -> None:
    """Refuse, on every rank and before any weight is converted, a policy of a family megatron is
    not tested with, any model whose config :func:`megatron_config` cannot convert, and, with ``pp``
    pipeline stages, a sequence-classification reward model (a second pipelined model; at
    ``pp=1`` it runs as a critic-style trunk, see :func:`~rltrainer.rewards.model.sequence_scores`)
    or a model whose hidden size is not the policy's (a larger teacher). A mixture of experts runs
    at ``tp=1`` (megatron-core's ``MoELayer`` trains with tensor parallelism only under sequence
    parallelism, ``moe_layer.py:379-383``, which these models do not run) and ``pp=1`` (the routing
    record spans every layer); ``ep`` expert-parallel ranks need a mixture-of-experts policy whose
    experts they divide."""
    if getattr(module, "policy", None) is None:
        raise RuntimeError(f"{type(module).__name__}.configure_model() must set self.policy")
    check_causal_lm(module.policy, "megatron")
    megatron_config(module.policy.config)  # its RULES: a field megatron-core cannot convert is named first
    policy = module.policy.config
    if ep > 1 and not is_moe(policy):
        raise ValueError(f"expert_model_parallel_size={ep} splits a mixture of experts' experts over ranks; the policy "
                         f"is a dense {policy.model_type} model (mixtures of experts: "
                         f"{', '.join(sorted(MOE_MODEL_TYPES))}). Use expert_model_parallel_size=1.")
    if ep > 1 and policy.num_experts % ep:
        raise ValueError(f"expert_model_parallel_size={ep} must divide the policy's {policy.num_experts} experts")
    if pp > 1 and is_moe(policy):
        raise NotImplementedError(
            f"pipeline_model_parallel_size={pp} with a mixture-of-experts policy ({policy.model_type}): the routing "
            "metrics and load-balancing loss (the Routing part's, transformers' load_balancing_loss_func over every "
            "layer's routers together) are computed with the loss, on the last stage, which holds only its own "
            "layers' routers. Use pipeline_model_parallel_size=1 and split the experts with "
            "expert_model_parallel_size, or strategy='fsdp2'.")
    for name, model in module.named_children():
        if not (hasattr(model, "config") and any(True for _ in model.parameters())):
            continue
        if type(model).__name__.endswith("ForSequenceClassification") and pp > 1:
            raise NotImplementedError(
                f"pipeline_model_parallel_size={pp} runs one pipelined model per hook call; {name} "
                f"({type(model).__name__}, a reward model) is a second one: use pipeline_model_parallel_size=1 "
                "(tensor and data parallelism run it), or strategy='fsdp2'.")
        megatron_config(model.config)
        if tp > 1 and is_moe(model.config):
            raise NotImplementedError(
                f"tensor_model_parallel_size={tp} with a mixture of experts ({name}, {model.config.model_type}): "
                "megatron-core's MoELayer trains under tensor parallelism only with sequence parallelism "
                "(moe_layer.py:379), which strategy='megatron' does not run. Use tensor_model_parallel_size=1 and "
                "split the experts with expert_model_parallel_size (the layers with pipeline_model_parallel_size), or "
                "strategy='fsdp2'.")
        hidden, policy_hidden = getattr(model.config, "hidden_size", None), module.policy.config.hidden_size
        if pp > 1 and hidden != policy_hidden:
            raise NotImplementedError(
                f"pipeline_model_parallel_size={pp}: the schedule passes the policy's hidden states "
                f"(hidden_size={policy_hidden}) between stages, and {name} has hidden_size={hidden}. Use "
                "pipeline_model_parallel_size=1 for a model of another size (e.g. a larger teacher).")


def check_grouped_gemm(device: torch.device) -> None:
    """``moe_grouped_gemm=True`` runs Transformer Engine's ``TEGroupedMLP``: CUDA ranks with
    Transformer Engine installed only."""
    import importlib.util

    if device.type != "cuda" or importlib.util.find_spec("transformer_engine") is None:
        where = f"this rank runs on {device.type}" if device.type != "cuda" else "Transformer Engine is not installed"
        raise ValueError(f"moe_grouped_gemm=True runs the experts as Transformer Engine's TEGroupedMLP (grouped GEMM "
                         f"CUDA kernels), and {where}. Use moe_grouped_gemm=False (megatron-core's SequentialMLP: "
                         "the experts one after another, on any device).")


class HFReads:
    """A transformers model's tensors as one rank reads them: a layouts :data:`Reader` (``read``;
    ``None`` on a rank that receives a random init from rank 0), and the bytes read or received."""

    def __init__(self, read: Reader | None, params: dict[str, torch.Tensor], source: str,
                 from_rank_zero: bool = False) -> None:
        self.read, self.params, self.source, self.from_rank_zero = read, params, source, from_rank_zero
        self.loaded = 0

    def __call__(self, name: str, rows: Rows) -> torch.Tensor:
        tensor = self.read(name, rows)
        self.loaded += tensor.numel() * tensor.element_size()
        return tensor

    def shapes(self, name: str, rows: Rows) -> torch.Tensor:
        """The model's own (meta) tensors: what a receiving rank expects, without data."""
        return state_reader(self.params)(name, rows)

    def receive(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        tensor = torch.empty(like.shape, dtype=like.dtype, device=device)
        dist.recv(tensor, src=0)
        self.loaded += tensor.numel() * tensor.element_size()
        return tensor


def _export_source(megatron_name: str) -> str:
    """What an export converts for a megatron parameter: the parameter, or for an expert's weight
    the stack of its layer's experts, which holds the whole fused transformers tensor."""
    stack = expert_stack(megatron_name)
    return stack[0] if stack is not None else megatron_name


def _fill(gpt: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each ``(megatron name, tensor)`` into ``gpt``'s parameter as it comes; every one must be filled."""
    params = {n: p for n, p in gpt.state_dict(keep_vars=True).items() if not n.endswith("_extra_state")}
    unexpected, filled = [], set()
    with torch.no_grad():
        for name, tensor in tensors:
            if name in params:
                params[name].copy_(tensor)
                filled.add(name)
            else:
                unexpected.append(name)
    missing = sorted(set(params) - filled)
    if missing or unexpected:
        raise RuntimeError(f"Megatron layout mismatch: missing {missing}, unexpected {unexpected}")


def _nbytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)

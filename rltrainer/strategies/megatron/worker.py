"""The rank side of ``strategy="megatron"``: :class:`MegatronWorker`, one megatron-core rank
(a pipeline stage's tensor-parallel shard of each model). Its gradients and optimizer step are
megatron-core's own (:mod:`~rltrainer.strategies.megatron.optimizer`): the trainable models in
megatron's ``DistributedDataParallel``, stepped by megatron's (by default distributed) optimizer."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.strategies.megatron.cpu import cpu_placement, cpu_shims
from rltrainer.strategies.megatron.layouts import MegatronLayout, hf_from_megatron, hf_names_of, hf_to_megatron
from rltrainer.strategies.megatron.models import (
    MegatronCausalLM,
    MegatronValueModel,
    PipelineSlot,
    StageOutput,
    build_gpt,
)
from rltrainer.strategies.megatron.optimizer import MegatronOptimizer
from rltrainer.strategies.rank_worker import TrainingWorker
from rltrainer.strategies.strategy import load_local_training_state, local_training_state, normalize_optimizers
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.module import RLModule


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
        self._optimizer: MegatronOptimizer | None = None

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
        self._use_megatron_optimizer()

    def _use_megatron_optimizer(self) -> None:
        """Wrap the trainable models in megatron's DDP and step them with megatron's optimizer,
        built from the module's (see :class:`MegatronOptimizer`); the schedule's gradient hooks go
        on the config it reads (the pipeline slot's)."""
        trainable = {n: m for n, m in self.module.trainable_models().items()
                     if any(p.requires_grad for p in m.parameters())}
        self._optimizer = MegatronOptimizer(trainable, self.optimizers, self.schedulers, self.options, self.device)
        self._optimizer.attach(self._slot.config)
        self.optimizers = [self._optimizer]  # type: ignore[list-item]  # what run_train_step steps

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

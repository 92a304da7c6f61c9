"""The controller side of ``strategy="megatron"``: :class:`MegatronStrategy` (the rank layout,
which ranks report, checkpoints); the ranks are :class:`~rltrainer.strategies.megatron.worker.MegatronWorker`."""

from __future__ import annotations

from typing import Any

from rltrainer.strategies.dispatch import WorkerGroupStrategy
from rltrainer.strategies.megatron.worker import MegatronWorker
from rltrainer.strategies.strategy import STRATEGIES
from rltrainer.values import check_int


@STRATEGIES.register("megatron", description="megatron-core: tensor x pipeline x data parallel (Ray workers)")
class MegatronStrategy(WorkerGroupStrategy):
    """megatron-core training on ``devices x num_nodes`` ranks: ``tensor_model_parallel_size``
    ranks split each layer's matrices, ``pipeline_model_parallel_size`` stages split the layers,
    and the rest is data parallel. Ranks are ordered as megatron-core orders them: tensor-parallel
    first, then data-parallel, then pipeline stages. A mixture of experts (Qwen3-MoE, Mixtral) may
    split its experts over ``expert_model_parallel_size`` of the data-parallel ranks.

    Args:
        tensor_model_parallel_size: ranks that split each layer's matrices.
        pipeline_model_parallel_size: stages the decoder layers are split into (evenly); the hooks
            run in megatron-core's 1F1B schedule.
        expert_model_parallel_size: for a mixture-of-experts policy, the data-parallel ranks its
            experts are split over (each holds ``num_experts / expert_model_parallel_size`` of
            every layer's experts; tokens travel to their experts and back by megatron-core's
            all-to-all dispatcher). It divides the data-parallel size; everything but the experts
            stays data parallel over those ranks. A mixture of experts trains at
            ``tensor_model_parallel_size=1`` (megatron-core's MoE layer needs sequence parallelism
            under tensor parallelism).
        moe_grouped_gemm: run each rank's experts as Transformer Engine's ``TEGroupedMLP`` (one
            grouped GEMM) instead of megatron-core's ``SequentialMLP`` (one expert after another);
            GPU ranks with Transformer Engine only (refused elsewhere). Its weight layout is
            tested; the model itself has not run in this project's CI (no GPU).
        use_distributed_optimizer: step with megatron-core's distributed optimizer (each
            data-parallel rank keeps and steps a shard of the optimizer state and main parameters,
            gradients are reduce-scattered and the updated parameters all-gathered); ``False``:
            megatron-core's plain optimizer on every rank (gradients all-reduced). Either way it is
            built from ``configure_optimizers()``: AdamW / Adam (SGD with ``False``).
        overlap_grad_reduce: launch each gradient bucket's reduction from the backward pass of the
            last micro-batch (megatron's DDP), instead of all at once after it.
        grad_reduce_in_fp32: keep and reduce gradients in fp32 (matters for ``bf16-true``).
        ddp_bucket_size: elements per gradient bucket with ``overlap_grad_reduce`` (``None``:
            megatron's default, ``max(40M, 1M x data-parallel size)``).
        devices / num_nodes / cpus_per_worker / gpus_per_worker / threads_per_worker / ray_init_kwargs:
            as for :class:`~rltrainer.strategies.fsdp2.FSDP2Strategy`.
        micro_batch_size / max_tokens_per_micro_batch / gradient_clip_val / precision / padding_free:
            micro-batching, clipping and precision, see :class:`~rltrainer.strategies.strategy.Strategy`
            (``padding_free=False`` and ``precision`` ``"32-true"`` or ``"bf16-true"`` here).

    The rollout engine's placement and weight sync are the :class:`~rltrainer.rollout.rollout.Rollout`'s.
    """

    name = "megatron"
    worker_cls = MegatronWorker

    def __init__(self, devices: int | str = 1, num_nodes: int = 1, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                 moe_grouped_gemm: bool = False, use_distributed_optimizer: bool = True,
                 overlap_grad_reduce: bool = False, grad_reduce_in_fp32: bool = True,
                 ddp_bucket_size: int | None = None, cpus_per_worker: float = 1.0, gpus_per_worker: float | None = None,
                 threads_per_worker: int | None = None, ray_init_kwargs: dict[str, Any] | None = None,
                 micro_batch_size: int = 8, max_tokens_per_micro_batch: int | None = None,
                 gradient_clip_val: float | None = 1.0, precision: str = "32-true", padding_free: bool = False) -> None:
        super().__init__(devices, num_nodes, cpus_per_worker, gpus_per_worker, threads_per_worker, ray_init_kwargs,
                         micro_batch_size, max_tokens_per_micro_batch, gradient_clip_val, precision, padding_free)
        tp = check_int("tensor_model_parallel_size", tensor_model_parallel_size, at_least=1, owner="MegatronStrategy")
        pp = check_int("pipeline_model_parallel_size", pipeline_model_parallel_size, at_least=1,
                       owner="MegatronStrategy")
        if self.world_size % (tp * pp):
            raise ValueError(f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} must divide the "
                             f"{self.world_size} ranks (devices x num_nodes)")
        ep = check_int("expert_model_parallel_size", expert_model_parallel_size, at_least=1, owner="MegatronStrategy")
        dp = self.world_size // (tp * pp)
        if dp % ep:
            raise ValueError(f"expert_model_parallel_size={ep} must divide the data-parallel size, {dp} "
                             f"({self.world_size} ranks / (tensor_model_parallel_size={tp} x "
                             f"pipeline_model_parallel_size={pp}))")
        if self.padding_free:
            raise ValueError("strategy='megatron' takes padded micro-batches only (padding_free=True packs rows "
                             "into one sequence, which its model and pipeline schedule do not read): use "
                             "padding_free=False with megatron, or strategy='fsdp2' / 'single' to pack")
        if self.precision in ("bf16-mixed", "16-mixed"):
            raise ValueError(f"strategy='megatron' takes precision '32-true' or 'bf16-true', got {self.precision!r}")
        ddp_bucket_size = check_int("ddp_bucket_size", ddp_bucket_size, at_least=1, owner="MegatronStrategy",
                                    none="megatron's default", meaning="elements")
        self.tp, self.pp = tp, pp
        self.options.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, moe_grouped_gemm=bool(moe_grouped_gemm),
                            use_distributed_optimizer=bool(use_distributed_optimizer),
                            overlap_grad_reduce=bool(overlap_grad_reduce),
                            grad_reduce_in_fp32=bool(grad_reduce_in_fp32), ddp_bucket_size=ddp_bucket_size)

    def data_parallel_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def reports(self, rank: int) -> bool:
        return rank // (self.tp * self.data_parallel_size) == self.pp - 1  # the last pipeline stage

    def _training_state(self) -> Any:
        return {"ranks": self.require_group().execute_all("state_dict"), "tensor_model_parallel_size": self.tp,
                "pipeline_model_parallel_size": self.pp}

    def _load_training_state(self, state: Any) -> None:
        have = (len(state["ranks"]), state.get("tensor_model_parallel_size"),
                state.get("pipeline_model_parallel_size", 1))
        if have != (self.world_size, self.tp, self.pp):
            raise ValueError(f"This checkpoint has {have[0]} ranks with tensor_model_parallel_size={have[1]}, "
                             f"pipeline_model_parallel_size={have[2]}; this run has {self.world_size} with {self.tp}, "
                             f"{self.pp}")
        self.require_group().dispatch("load_state_dict", [((s,), {}) for s in state["ranks"]])

    def checkpoint_layout(self) -> dict[str, int]:
        return {"world_size": self.world_size, "tensor_model_parallel_size": self.tp,
                "pipeline_model_parallel_size": self.pp}

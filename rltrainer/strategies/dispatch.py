"""The controller side of a multi-process strategy: :class:`WorkerGroupStrategy` and its dispatch.

It runs in the controller. It starts the ranks (one in-process worker for a single rank, no Ray,
so breakpoints work; Ray actors in a placement group otherwise), splits each batch across the
data-parallel shares, balanced by token count, with the same number of micro-batches on every rank
(:func:`partition_for_ranks`: collectives must match; a rank short of rows runs a zero-weight
padding micro-batch). The rollout engines it hosts (colocated) or whose Ray resources it lends
(split) are placed by :class:`~rltrainer.rollout.rollout.Rollout`. Subclasses (``fsdp2``, ``megatron``) name their
rank class (a :class:`~rltrainer.strategies.rank_worker.TrainingWorker`, the rank side) and how
ranks map to shares.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.controller.methods import BoundRemote
from rltrainer.controller.reaper import shutdown_ray
from rltrainer.controller.worker_group import InProcessWorkerGroup, RayWorkerGroup, WorkerGroup, ensure_ray
from rltrainer.data.batch import RolloutBatch
from rltrainer.files import raising_ranks_disk_full
from rltrainer.strategies.rank_worker import TrainingWorker
from rltrainer.strategies.strategy import Strategy, combine_metrics, form_micro_batches
from rltrainer.values import check_float, check_int

if TYPE_CHECKING:
    from rltrainer.module import RLModule

log = logging.getLogger(__name__)


class WorkerGroupStrategy(Strategy):
    """A strategy whose ranks are :class:`TrainingWorker` processes (the arguments are documented on
    :class:`~rltrainer.strategies.fsdp2.FSDP2Strategy`)."""

    name = "worker_group"
    worker_cls: type[TrainingWorker] = TrainingWorker
    trains_lora = False  # whether its ranks export a LoRA policy (rltrainer.lora.LoraView)

    def __init__(self, devices: int | str, num_nodes: int, cpus_per_worker: float, gpus_per_worker: float | None,
                 threads_per_worker: int | None, ray_init_kwargs: dict[str, Any] | None, micro_batch_size: int,
                 max_tokens_per_micro_batch: int | None, gradient_clip_val: float | None, precision: str,
                 padding_free: bool) -> None:
        super().__init__(micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                         gradient_clip_val=gradient_clip_val, precision=precision, padding_free=padding_free)
        if devices == "auto":
            devices = max(torch.cuda.device_count(), 1)
        devices = check_int("devices", devices, at_least=1, meaning="training ranks per node, or 'auto'",
                            owner=type(self).__name__)
        num_nodes = check_int("num_nodes", num_nodes, at_least=1, owner=type(self).__name__)
        # cpus_per_worker is checked and kept as written: Ray's resource messages then say 64, not 64.0
        check_float("cpus_per_worker", cpus_per_worker, above=0, owner=type(self).__name__)
        gpus_per_worker = check_float("gpus_per_worker", gpus_per_worker, at_least=0, owner=type(self).__name__,
                                      none="1 where the cluster has GPUs, else 0")
        threads_per_worker = check_int("threads_per_worker", threads_per_worker, at_least=1, owner=type(self).__name__,
                                       none="cpus_per_worker")
        self.world_size_ = devices * num_nodes
        self.options: dict[str, Any] = {"precision": self.precision, "gradient_clip_val": self.gradient_clip_val,
                                        "padding_free": self.padding_free}
        self.cpus_per_worker, self.gpus_per_worker = cpus_per_worker, gpus_per_worker
        self.threads_per_worker = threads_per_worker or max(1, int(cpus_per_worker))
        self.ray_init_kwargs = ray_init_kwargs
        self.group: WorkerGroup | None = None
        self._started_ray = False
        self._config: Any = None
        self._weight_names: list[str] = []

    @property
    def world_size(self) -> int:
        return self.world_size_

    # -- setup -----------------------------------------------------------------------------------
    def ray_group(self, worker_cls: type, size: int, name: str,
                  runtime_env: dict[str, Any] | None = None) -> RayWorkerGroup:
        """``size`` Ray processes of ``worker_cls`` with this strategy's resources per process (the
        training ranks', and a rollout's split replicas'), started in Ray's placement group ``name``."""
        import ray

        self._started_ray = ensure_ray(self.ray_init_kwargs) or self._started_ray
        gpus = self.gpus_per_worker
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        return RayWorkerGroup(worker_cls, size, name=name, cpus_per_worker=self.cpus_per_worker,
                              gpus_per_worker=gpus, watchdog=self.watchdog, runtime_env=runtime_env,
                              threads=self.threads_per_worker)

    def setup(self, module: RLModule, seed: int) -> None:
        self.lora_config = getattr(module, "lora", None)
        if self.lora_config is not None and not self.trains_lora:
            raise ValueError(f"strategy={self.name!r} does not train LoRA policies (the module has lora=...). Use "
                             "strategy='fsdp2' or 'single', or train the full model (lora=None).")
        if self.world_size == 1:
            self.group = InProcessWorkerGroup(self.worker_cls, name="actor")
            payload: Any = module
        else:
            import ray

            self.group = self.ray_group(self.worker_cls, self.world_size, "actor")
            ship_user_code(module)
            payload = ray.put(module)  # serialised once for all ranks
        addr, port = self.group.remote.master_address()
        self.group.remote.init_distributed(addr, port)
        self.group.remote.setup(payload, self.options, seed)
        self._after_setup()
        self._config = self.group.remote.model_config()
        self._weight_names = self.group.remote.weight_names()

    def _after_setup(self) -> None:
        """Called once the ranks have set up (subclass hook)."""

    def data_parallel_rank(self, rank: int) -> int:
        """Which share of a batch rank ``rank`` trains on (ranks of one share see the same rows)."""
        return rank

    @property
    def data_parallel_size(self) -> int:
        return self.world_size

    def require_group(self) -> WorkerGroup:
        """The training ranks (after :meth:`setup`)."""
        if self.group is None:
            raise RuntimeError(f"{type(self).__name__} is not set up (Trainer.fit calls setup) or was torn down")
        return self.group

    # -- compute ---------------------------------------------------------------------------------
    def _dispatch(self, method: BoundRemote, batch: RolloutBatch, *extra: Any) -> tuple[list[Any], list[torch.Tensor]]:
        """Split ``batch`` into data-parallel shares and run ``method`` (``group.remote.compute``...)
        on every rank; returns one output per share (from the share's first rank) and the batch
        rows of each share."""
        parts, rows = partition_for_ranks(batch, self.data_parallel_size, self.micro_batch_size,
                                          self.max_tokens_per_micro_batch, self.padding_free)
        shares = [self.data_parallel_rank(r) for r in range(self.world_size)]
        outs = method.each([(parts[s], *extra) for s in shares]).get()
        first = {s: outs[r] for r, s in reversed(list(enumerate(shares))) if self.reports(r)}
        return [first[s] for s in range(self.data_parallel_size)], rows

    def reports(self, rank: int) -> bool:
        """Whether rank ``rank`` returns its share's outputs and metrics (every rank of a share
        computes them; a pipeline stage before the last holds none)."""
        return True

    def compute(self, batch: RolloutBatch, stage: str) -> RolloutBatch:
        outs, rows = self._dispatch(self.require_group().remote.compute, batch, stage)
        merged: dict[str, torch.Tensor] = {}
        for key in outs[0]:
            first = outs[0][key]
            full = torch.empty((len(batch), *first.shape[1:]), dtype=first.dtype)
            for out, idx in zip(outs, rows):
                full[idx] = out[key][: len(idx)]
            merged[key] = full
        return RolloutBatch(merged, batch_size=len(batch))

    def train_step(self, mini_batch: RolloutBatch) -> dict[str, float]:
        outs, _ = self._dispatch(self.require_group().remote.train_step, mini_batch)
        metrics = combine_metrics(outs)  # global-normalised parts add up; *_max / *_min reduce
        metrics["actor/grad_norm"] = outs[0]["actor/grad_norm"]  # already the global norm on every rank
        metrics["actor/lr"] = outs[0]["actor/lr"]
        return metrics

    # -- weights -----------------------------------------------------------------------------------
    def export_weights(self, dtype: torch.dtype | None = None,
                       only_changed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Gather the policy to this process bucket by bucket (rank 0 returns each, Ray carries it)."""
        group = self.require_group()
        buckets, _ = group.remote.plan_weights(dtype, only_changed)[0]
        for index in range(buckets):
            yield from group.remote.export_bucket(index)[0].views()
        group.remote.finish_weights()

    def weight_names(self) -> list[str]:
        return list(self._weight_names)

    def set_weight_view(self, mode: str | None) -> None:
        """Every rank exports its LoRA policy as ``mode`` (see :mod:`rltrainer.lora`)."""
        if mode is None and self.weight_view is None:
            return
        group = self.require_group()
        group.remote.set_weight_view(mode)
        self._weight_names = group.remote.weight_names()
        self.weight_view = mode

    def forget_synced(self, groups: list[list[str]] | None = None) -> None:
        if groups is not None:
            self.require_group().remote.set_weight_groups(groups)  # the sender keeps them whole (and forgets)
        else:
            self.require_group().remote.forget_synced()  # every rank: the next sync sends every weight

    # -- state -------------------------------------------------------------------------------------
    def model_config(self) -> Any:
        return self._config

    def state_dict(self) -> dict[str, Any]:
        """Models, optimizers, schedulers, and every rank's RNG state (a colocated engine samples with
        it, so a resumed run draws the samples an uninterrupted one would)."""
        return {"training": self._training_state(), "rng": self.require_group().remote.rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_training_state(state["training"])
        self._set_rng_states(state)

    def save_checkpoint(self, directory: Path, async_save: bool = False) -> dict[str, Any]:
        """Every rank writes its own part into ``directory`` (``TrainingWorker.save_checkpoint``;
        nothing passes through this process); this process keeps the layout and every rank's RNG
        state (a split rollout's replicas keep theirs: :meth:`Rollout.state_dict
        <rltrainer.rollout.rollout.Rollout.state_dict>`)."""
        with raising_ranks_disk_full():
            self.require_group().remote.save_checkpoint(str(directory), async_save)
        return {"layout": self.checkpoint_layout(), "rng": self.require_group().remote.rng_state()}

    def load_checkpoint(self, directory: Path, state: dict[str, Any], *, optimizer: bool = True) -> None:
        self.check_checkpoint_layout(directory, state.get("layout", {}))
        self.require_group().remote.load_checkpoint(str(directory), optimizer)
        self._set_rng_states(state)  # only if saved with as many ranks (else each keeps its own)

    def wait_checkpoint(self) -> None:
        if self.group is not None:
            with raising_ranks_disk_full():
                self.group.remote.wait_checkpoint()

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        """Every rank hashes the files it wrote (nothing is read here)."""
        return {name: digest for part in self.require_group().remote.checkpoint_digests(str(directory))
                for name, digest in part.items()}

    def verify_checkpoint(self, directory: Path, expected: dict[str, str]) -> list[str]:
        """Every rank checks a share of the files (nothing is read here)."""
        return [line for part in self.require_group().remote.verify_checkpoint(str(directory), expected)
                for line in part]

    def checkpoint_layout(self) -> dict[str, int]:
        """How the ranks split the state when saving (a checkpoint records it)."""
        return {"world_size": self.world_size}

    def check_checkpoint_layout(self, directory: Path, layout: dict[str, int]) -> None:
        """Raise if this run cannot read a checkpoint of ``layout`` (here: any, the ranks reshard)."""

    def _set_rng_states(self, state: dict[str, Any]) -> None:
        if len(state["rng"]) == self.world_size:
            self.require_group().remote.set_rng_state.each([(s,) for s in state["rng"]]).get()

    def _training_state(self) -> Any:
        return self.require_group().remote.state_dict()[0]  # rank 0 holds the full state

    def _load_training_state(self, state: Any) -> None:
        group = self.require_group()
        if isinstance(group, RayWorkerGroup):
            import ray

            state = ray.put(state)  # one copy for every rank
        group.remote.load_state_dict(state)

    def teardown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        self.group = None
        if self._started_ray:
            shutdown_ray()  # and its watcher (rltrainer.controller.reaper)
            self._started_ray = False


def ship_user_code(module: Any) -> None:
    """Pickle the code of the module's class by value when it lives outside installed packages
    (a script's or a test's local module that the worker processes could not import)."""
    import sys

    from ray import cloudpickle

    for cls in type(module).__mro__:
        name = cls.__module__
        source = sys.modules.get(name)
        path = str(getattr(source, "__file__", "") or "")
        if source is None or name == "__main__" or name.split(".")[0] in ("rltrainer", "torch", "builtins"):
            continue
        if "site-packages" in path or "dist-packages" in path or not path:
            continue
        cloudpickle.register_pickle_by_value(source)


def partition_for_ranks(batch: RolloutBatch, world_size: int, micro_batch_size: int, max_tokens: int | None,
                        padding_free: bool = False) -> tuple[list[list[RolloutBatch]], list[torch.Tensor]]:
    """Rank ``r``'s micro-batches and the batch rows they hold (real rows first, in order).

    Rows go to ranks balanced by token count (longest first, to the least loaded rank with room;
    at most ``ceil(N / world_size)`` rows each). Every rank gets the same number of micro-batches;
    a rank with fewer pads with one-row micro-batches (``padding``) whose ``response_mask``
    and ``advantages`` are all zero. The hooks run on them (the collectives must match), and their
    contribution is removed by the strategy: :func:`~rltrainer.strategies.strategy.zero_padding`
    multiplies the loss by 0 and drops the metrics, and compute outputs are dropped. Each rank's
    rows form micro-batches as :func:`~rltrainer.strategies.strategy.form_micro_batches` forms them
    (``padding_free``: packed, the micro-batches' field set so).
    """
    n = len(batch)
    tokens = batch["attention_mask"].sum(-1).tolist() if "attention_mask" in batch else [1] * n
    cap = -(-n // world_size)
    loads, assigned = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(n), key=lambda i: -tokens[i]):
        rank = min((r for r in range(world_size) if len(assigned[r]) < cap), key=lambda r: (loads[r], r))
        assigned[rank].append(i)
        loads[rank] += tokens[i]
    rows = [torch.tensor(sorted(a), dtype=torch.long) for a in assigned]
    parts = []
    for idx in rows:
        parts.append(form_micro_batches(batch[idx], micro_batch_size, max_tokens, padding_free) if len(idx) else [])
    count = max(len(p) for p in parts)
    if any(len(p) < count for p in parts):
        pad = form_micro_batches(batch[[0]], 1, None, padding_free)[0].copy()
        for key in ("response_mask", "advantages"):
            if key in pad:
                pad[key] = torch.zeros_like(pad[key])
        pad.padding = True
        for p in parts:
            p.extend(pad for _ in range(count - len(p)))
    return parts, rows

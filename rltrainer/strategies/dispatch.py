"""The controller side of a multi-process strategy: :class:`WorkerGroupStrategy` and its dispatch.

It runs in the controller. It starts the ranks (one in-process worker for a single rank, no Ray,
so breakpoints work; Ray actors in a placement group otherwise), splits each batch across the
data-parallel shares, balanced by token count, with the same number of micro-batches on every rank
(:func:`partition_for_ranks`: collectives must match; a rank short of rows runs a zero-weight
padding micro-batch), places the rollout engines (colocated or split), and picks the weight
transport (:mod:`rltrainer.weights.transports`). Subclasses (``fsdp2``, ``megatron``) name their
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
from rltrainer.controller.worker_group import (InProcessWorkerGroup, RayWorkerGroup, WorkerGroup, ensure_ray,
                                               get_together)
from rltrainer.data.batch import RolloutBatch
from rltrainer.files import raising_ranks_disk_full
from rltrainer.lora import engine_view
from rltrainer.rollout.adapters import adapter_config_dict
from rltrainer.rollout.engine import ModelFiles
from rltrainer.rollout.remote import RemoteEngine
from rltrainer.rollout.worker import InOrderWorker, Worker
from rltrainer.strategies.rank_worker import TrainingWorker
from rltrainer.strategies.strategy import Strategy, combine_metrics, form_micro_batches, refuse_other_environment
from rltrainer.values import check_float, check_int
from rltrainer.weights.delta import DeltaSync
from rltrainer.weights.group import DEFAULT_TIMEOUT_S
from rltrainer.weights.transports import (WEIGHT_TRANSPORTS, BroadcastTransport, ColocatedTransport,
                                          InProcessTransport, ObjectStoreTransport, SharedMemoryTransport,
                                          WeightTransport, resolve_transport)
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)

PLACEMENTS = ("colocated", "split")


class WorkerGroupStrategy(Strategy):
    """A strategy whose ranks are :class:`TrainingWorker` processes. Args: see :class:`FSDP2Strategy`."""

    name = "distributed"
    worker_cls: type[TrainingWorker] = TrainingWorker
    trains_lora = False  # whether its ranks export a LoRA policy (rltrainer.lora.LoraView)

    def __init__(self, devices: int | str = 1, num_nodes: int = 1, rollout_placement: str = "colocated",
                 rollout_replicas: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES, cpus_per_worker: float = 1.0,
                 gpus_per_worker: float | None = None, threads_per_worker: int | None = None,
                 ray_init_kwargs: dict[str, Any] | None = None, weight_transport: str = "auto",
                 weight_sync_timeout_s: float = DEFAULT_TIMEOUT_S, weight_sync_delta: bool | DeltaSync = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if devices == "auto":
            devices = max(torch.cuda.device_count(), 1)
        devices = check_int("devices", devices, at_least=1, meaning="training ranks per node, or 'auto'",
                            owner=type(self).__name__)
        num_nodes = check_int("num_nodes", num_nodes, at_least=1, owner=type(self).__name__)
        if rollout_placement not in PLACEMENTS:
            raise ValueError(f"rollout_placement={rollout_placement!r}; choose from {', '.join(PLACEMENTS)}")
        rollout_replicas = check_int("rollout_replicas", rollout_replicas, at_least=1, owner=type(self).__name__,
                                     meaning="engine replicas with split placement")
        bucket_bytes = check_int("bucket_bytes", bucket_bytes, at_least=1, owner=type(self).__name__,
                                 meaning="bytes of a weight-sync bucket")
        # cpus_per_worker is checked and kept as written: Ray's resource messages then say 64, not 64.0
        check_float("cpus_per_worker", cpus_per_worker, above=0, owner=type(self).__name__)
        gpus_per_worker = check_float("gpus_per_worker", gpus_per_worker, at_least=0, owner=type(self).__name__,
                                      none="1 where the cluster has GPUs, else 0")
        threads_per_worker = check_int("threads_per_worker", threads_per_worker, at_least=1, owner=type(self).__name__,
                                       none="cpus_per_worker")
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport={weight_transport!r}; choose from {', '.join(WEIGHT_TRANSPORTS)} "
                             "(how split placement moves weights to the rollout replicas)")
        check_weight_sync_timeout(weight_sync_timeout_s)
        self.world_size_ = devices * num_nodes
        self.options: dict[str, Any] = {"precision": self.precision, "gradient_clip_val": self.gradient_clip_val,
                                        "padding_free": self.padding_free}
        self.rollout_placement, self.rollout_replicas = rollout_placement, rollout_replicas
        self.bucket_bytes = bucket_bytes
        self.cpus_per_worker, self.gpus_per_worker = cpus_per_worker, gpus_per_worker
        self.threads_per_worker = threads_per_worker or max(1, int(cpus_per_worker))
        self.ray_init_kwargs = ray_init_kwargs
        self.group: WorkerGroup | None = None
        self.rollout_group: WorkerGroup | None = None
        self.remote_engine: RemoteEngine | None = None
        self.weight_transport = weight_transport
        self.weight_sync_timeout_s = float(weight_sync_timeout_s)
        self.weight_sync_delta = DeltaSync.resolve(weight_sync_delta)
        self.transport: WeightTransport | None = None  # to remote_engine
        self._started_ray = False
        self._config: Any = None
        self._weight_names: list[str] = []
        self._seed = 0

    @property
    def world_size(self) -> int:
        return self.world_size_

    # -- setup -----------------------------------------------------------------------------------
    def _ray_group(self, worker_cls: type, size: int, name: str, runtime_env: dict[str, Any] | None = None,
                   **init_kwargs: Any) -> RayWorkerGroup:
        import ray

        self._started_ray = ensure_ray(self.ray_init_kwargs) or self._started_ray
        gpus = self.gpus_per_worker
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        return RayWorkerGroup(worker_cls, size, name=name, cpus_per_worker=self.cpus_per_worker,
                              gpus_per_worker=gpus, watchdog=self.watchdog, runtime_env=runtime_env,
                              threads=self.threads_per_worker, **init_kwargs)

    def setup(self, module: RLModule, seed: int) -> None:
        self.lora_config = getattr(module, "lora", None)
        if self.lora_config is not None and not self.trains_lora:
            raise ValueError(f"strategy={self.name!r} does not train LoRA policies (the module has lora=...). Use "
                             "strategy='fsdp2' or 'single', or train the full model (lora=None).")
        if self.world_size == 1:
            self.group = InProcessWorkerGroup(self.worker_cls, name="actor", bucket_bytes=self.bucket_bytes)
            payload: Any = module
        else:
            import ray

            self.group = self._ray_group(self.worker_cls, self.world_size, "actor", bucket_bytes=self.bucket_bytes)
            ship_user_code(module)
            payload = ray.put(module)  # serialised once for all ranks
        addr, port = self.group.remote.master_address()
        self.group.remote.init_distributed(addr, port)
        self.group.remote.setup(payload, self.options, seed)
        self._seed = seed
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

    def connect_engine(self, engine: RolloutEngine, tokenizer: Any) -> RolloutEngine:
        """Colocated: one replica in every training process. Split: ``rollout_replicas`` Ray
        processes of their own (in their own placement group), fed by the transport
        ``weight_transport`` resolves to (:meth:`_split_transport`)."""
        if self.weight_sync_delta is not None and self.rollout_placement == "split" and engine.native_weight_broadcast:
            raise ValueError(f"weight_sync_delta is on, but {type(engine).__name__} receives weight broadcasts itself "
                             "(native_weight_broadcast) and cannot apply a delta; use weight_sync_delta=False with "
                             "it, or an engine that loads through update_weights (hf, vllm)")
        group = self._require_group()
        for device_type in sorted(set(group.remote.device_type())):  # split replicas get the ranks' resources
            engine.check_model(self._config, device_type)  # before any replica starts
        k = engine.ranks_per_replica
        runtime_env = engine.runtime_env  # another Python environment, if the engine has one
        if self.rollout_placement == "split":
            if self.rollout_group is not None:  # connected before: replace the old replicas
                self._close_rollout_group()
            # one process per replica receives weights beside its requests; a replica spanning several
            # (tensor parallel) receives in order with them, so all its ranks change weights at one point
            worker = Worker if k == 1 else InOrderWorker
            group = self.rollout_group = self._ray_group(worker, self.rollout_replicas * k, "rollout",
                                                         runtime_env=runtime_env)
            group.remote.seed_rng(self._seed + 10_000)  # the replicas sample: same seed, same run
            if k > 1:  # the replicas' processes form a torch.distributed group (vLLM's external_launcher)
                addr, port = group.remote.master_address()
                group.remote.init_distributed(addr, port)
        elif self.world_size % k:
            raise ValueError(f"A {type(engine).__name__} replica spans {k} processes; colocated, that must divide "
                             f"the {self.world_size} training ranks")
        else:
            refuse_other_environment(engine, runtime_env, "colocated with the training ranks")
        view = engine_view(self.lora_config, engine)
        dtype = getattr(engine, "dtype", None)
        if self.rollout_placement == "split":  # resolved, and checked with the engine, before it starts
            self.transport = self._split_transport(group, dtype)
            engine.check_split_transport(self.transport.name, adapter=view == "adapter")
        files = runtime_env is not None and self.rollout_placement == "split"  # another transformers, maybe
        config, tok = (ModelFiles.of(self._config, tokenizer), None) if files else (self._config, tokenizer)
        lora = self.lora_config if view == "adapter" else None
        if files and lora is not None:  # peft may be missing there: adapter_config.json as a dict
            lora = adapter_config_dict(lora)
        group.remote.setup_engine(engine, config, tok, lora)
        self.set_weight_view(view)
        groups = group.remote.engine_weight_groups(self._weight_names)
        self.group.remote.set_weight_groups(groups)  # the sender keeps them whole (and forgets the synced)
        split = self.rollout_placement == "split"
        self.group.remote.configure_weight_delta(self.weight_sync_delta if split else None)
        if split:
            group.remote.configure_delta_receiver(self.weight_sync_delta)
        if self.weight_sync_delta is not None and not split:
            log.info("weight_sync_delta: colocated engines copy each weight in place (a diff scan reads as many bytes "
                     "as that copy writes), so they sync in full")
        if split:
            self.transport.connect()
        else:
            self.transport = ColocatedTransport(self.group, dtype)
        self.remote_engine = RemoteEngine(group, tokenizer, dtype, ranks_per_replica=k)
        self.remote_engine.return_routed_experts = engine.return_routed_experts  # what its replicas were asked
        return self.remote_engine

    def _split_transport(self, rollout: WorkerGroup, dtype: torch.dtype | None) -> WeightTransport:
        """``weight_transport``, with ``"auto"`` resolved (:func:`~rltrainer.weights.transports.resolve_transport`):
        broadcast when trainer rank 0 and every replica are on GPUs (NCCL); shared memory when every
        replica is on trainer rank 0's node; else Ray's object store."""
        trainer = self._require_group()
        devices = {trainer.remote.device_type.on_rank_zero(), *rollout.remote.device_type()}
        same_node = set(rollout.remote.node_ip()) == {trainer.remote.node_ip.on_rank_zero()}
        name = resolve_transport(self.weight_transport, devices, same_node)
        delta = self.weight_sync_delta is not None
        if name == "broadcast":
            return BroadcastTransport(trainer, rollout, dtype, get_together, timeout_s=self.weight_sync_timeout_s,
                                      delta=delta)
        if name == "shared_memory":
            return SharedMemoryTransport(trainer, rollout, dtype, get_together, delta=delta)
        return ObjectStoreTransport(trainer, rollout, dtype, get_together, delta=delta)

    def _require_group(self) -> WorkerGroup:
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
        outs, rows = self._dispatch(self._require_group().remote.compute, batch, stage)
        merged: dict[str, torch.Tensor] = {}
        for key in outs[0]:
            first = outs[0][key]
            full = torch.empty((len(batch), *first.shape[1:]), dtype=first.dtype)
            for out, idx in zip(outs, rows):
                full[idx] = out[key][: len(idx)]
            merged[key] = full
        return RolloutBatch(merged, batch_size=len(batch))

    def train_step(self, mini_batch: RolloutBatch) -> dict[str, float]:
        outs, _ = self._dispatch(self._require_group().remote.train_step, mini_batch)
        metrics = combine_metrics(outs)  # global-normalised parts add up; *_max / *_min reduce
        metrics["actor/grad_norm"] = outs[0]["actor/grad_norm"]  # already the global norm on every rank
        metrics["actor/lr"] = outs[0]["actor/lr"]
        return metrics

    # -- weights -----------------------------------------------------------------------------------
    def export_weights(self, dtype: torch.dtype | None = None,
                       only_changed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Gather the policy to this process bucket by bucket (rank 0 returns each, Ray carries it)."""
        group = self._require_group()
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
        group = self._require_group()
        group.remote.set_weight_view(mode)
        self._weight_names = group.remote.weight_names()
        self.weight_view = mode

    def forget_synced(self) -> None:
        self._require_group().remote.forget_synced()  # every rank: the next sync sends every weight

    def transport_for(self, engine: RolloutEngine) -> WeightTransport:
        """The transport :meth:`connect_engine` chose for its replicas; an engine in this process
        pulls :meth:`export_weights`."""
        if engine is self.remote_engine and self.transport is not None:
            return self.transport
        return InProcessTransport(self, engine)

    # -- state -------------------------------------------------------------------------------------
    def model_config(self) -> Any:
        return self._config

    def state_dict(self) -> dict[str, Any]:
        """Models, optimizers, schedulers, and every rank's RNG state, the split replicas' too (the
        engines sample with them, so a resumed run draws the samples an uninterrupted one would)."""
        state = {"training": self._training_state(), "rng": self._require_group().remote.rng_state()}
        if self.rollout_group is not None:
            state["rollout_rng"] = self.rollout_group.remote.rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_training_state(state["training"])
        self._set_rng_states(state)

    def save_checkpoint(self, directory: Path, async_save: bool = False) -> dict[str, Any]:
        """Every rank writes its own part into ``directory`` (``TrainingWorker.save_checkpoint``;
        nothing passes through this process); this process keeps the layout and every rank's RNG
        state, the split replicas' too."""
        with raising_ranks_disk_full():
            self._require_group().remote.save_checkpoint(str(directory), async_save)
        state = {"layout": self.checkpoint_layout(), "rng": self._require_group().remote.rng_state()}
        if self.rollout_group is not None:
            state["rollout_rng"] = self.rollout_group.remote.rng_state()
        return state

    def load_checkpoint(self, directory: Path, state: dict[str, Any]) -> None:
        self.check_checkpoint_layout(directory, state.get("layout", {}))
        self._require_group().remote.load_checkpoint(str(directory))
        self._set_rng_states(state)  # only if saved with as many ranks (else each keeps its own)

    def wait_checkpoint(self) -> None:
        if self.group is not None:
            with raising_ranks_disk_full():
                self.group.remote.wait_checkpoint()

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        """Every rank hashes the files it wrote (nothing is read here)."""
        return {name: digest for part in self._require_group().remote.checkpoint_digests(str(directory))
                for name, digest in part.items()}

    def verify_checkpoint(self, directory: Path, expected: dict[str, str]) -> list[str]:
        """Every rank checks a share of the files (nothing is read here)."""
        return [line for part in self._require_group().remote.verify_checkpoint(str(directory), expected)
                for line in part]

    def checkpoint_layout(self) -> dict[str, int]:
        """How the ranks split the state when saving (a checkpoint records it)."""
        return {"world_size": self.world_size}

    def check_checkpoint_layout(self, directory: Path, layout: dict[str, int]) -> None:
        """Raise if this run cannot read a checkpoint of ``layout`` (here: any, the ranks reshard)."""

    def _set_rng_states(self, state: dict[str, Any]) -> None:
        if len(state["rng"]) == self.world_size:
            self._require_group().remote.set_rng_state.each([(s,) for s in state["rng"]]).get()
        rollout_rng = state.get("rollout_rng")
        if self.rollout_group is not None and rollout_rng and len(rollout_rng) == self.rollout_group.world_size:
            self.rollout_group.remote.set_rng_state.each([(s,) for s in rollout_rng]).get()

    def _training_state(self) -> Any:
        return self._require_group().remote.state_dict()[0]  # rank 0 holds the full state

    def _load_training_state(self, state: Any) -> None:
        group = self._require_group()
        if isinstance(group, RayWorkerGroup):
            import ray

            state = ray.put(state)  # one copy for every rank
        group.remote.load_state_dict(state)

    def _close_rollout_group(self) -> None:
        """Release the split replicas (and the training ranks' end of their transport)."""
        if self.transport is not None and self.group is not None:
            self.transport.close()
        if self.rollout_group is not None:
            self.rollout_group.shutdown()
        self.rollout_group = self.transport = self.remote_engine = None

    def teardown(self) -> None:
        for group in (self.rollout_group, self.group):
            if group is not None:
                group.shutdown()
        self.group = self.rollout_group = self.remote_engine = self.transport = None
        if self._started_ray:
            shutdown_ray()  # and its watcher (rltrainer.controller.reaper)
            self._started_ray = False


def check_weight_sync_timeout(seconds: Any) -> None:
    """Raise unless ``seconds`` is a finite number of seconds > 0 (``weight_sync_timeout_s``)."""
    check_float("weight_sync_timeout_s", seconds, above=0, meaning=(
        "seconds the weight broadcast group waits for its members to join and for each bucket's broadcast; raise it "
        "for slow links or large buckets, or, with SGLang (which starts receiving a sync once its running request is "
        "done), for requests that run longer"))


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

"""``Rollout``: everything between the trainer and the engines (``Trainer(rollout=Rollout(...))``).

It owns where the engine runs (in the controller's process, in every training rank, or in
processes of its own), how many replicas there are, how weights reach them and the settings of a
sync (transport, timeout, delta, bucket size). :meth:`Rollout.connect` places the engine for a
strategy once it is set up and returns the one owner of its weight sync,
:class:`~rltrainer.weights.sync.WeightSync`. The Strategy computes and exports the weights; it
never places an engine. A string (``rollout="vllm"``) or an engine (``rollout=VLLMEngine(...)``)
is shorthand for ``Rollout(engine=...)`` with the defaults.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rltrainer.controller.watchdog import Watchdog
from rltrainer.controller.worker_group import WorkerGroup, get_together
from rltrainer.lora import engine_view
from rltrainer.rollout.adapters import adapter_config_dict
from rltrainer.rollout.engine import ModelFiles, RolloutEngine, build_engine
from rltrainer.rollout.remote import RemoteEngine
from rltrainer.rollout.worker import InOrderWorker, Worker
from rltrainer.strategies.dispatch import WorkerGroupStrategy
from rltrainer.strategies.strategy import Strategy
from rltrainer.values import check_float, check_int
from rltrainer.weights.delta import DeltaSync
from rltrainer.weights.group import DEFAULT_TIMEOUT_S
from rltrainer.weights.sync import WeightSync
from rltrainer.weights.transports import (WEIGHT_TRANSPORTS, BroadcastTransport, ColocatedTransport,
                                          InProcessTransport, ObjectStoreTransport, SharedMemoryTransport,
                                          WeightTransport, resolve_transport)
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)

PLACEMENTS = ("colocated", "split")


class Rollout:
    """The rollout engine and where it runs, and how weights reach it.

    Args:
        engine: ``"hf"`` (transformers, runs anywhere), a registered engine name, or a
            :class:`~rltrainer.rollout.engine.RolloutEngine` (its own settings:
            ``VLLMEngine(gpu_memory_utilization=0.5)``).
        placement: ``"colocated"`` (an engine replica in every training process: the hybrid
            engine; with the ``single`` strategy, in the controller's process) or ``"split"``
            (``replicas`` engine processes of their own, in their own Ray placement group, with a
            multi-process strategy: ``FSDP2Strategy``, ``MegatronStrategy``; weights go to them
            bucket by bucket, see ``transport``, received beside the request a replica is
            generating and applied between two requests: each replica holds one extra copy of the
            weights that changed since the last sync, on its device, while a sync arrives; see
            :mod:`rltrainer.weights.staging`). Split replicas get the training ranks' Ray
            resources (the strategy's ``cpus_per_worker``, ``gpus_per_worker``...).
        replicas: engine processes for ``"split"``.
        transport: how ``"split"`` moves weights to the replicas (:mod:`rltrainer.weights.transports`).
            ``"broadcast"``: trainer rank 0 and every replica's receiving processes (SGLang: its
            ``tp_size`` schedulers) form a process group of their own, NCCL when all are on GPUs,
            else gloo, and each bucket is one broadcast straight into the engines' devices.
            ``"shared_memory"``: every replica on trainer rank 0's node maps two ``/dev/shm``
            slots, rank 0 writes each bucket into one, the replicas load views of it.
            ``"object_store"``: rank 0 returns each bucket and Ray's object store carries it (any
            node; a copy through host memory per replica). ``"auto"`` (default): broadcast when
            everything is on GPUs, else shared memory on one node, else the object store.
        sync_timeout_s: ``"broadcast"``: how long the group's members wait for each other to join,
            and for each bucket's broadcast (default 600 s). Raise it for slow links or very large
            buckets; an engine that receives on its own (SGLang) starts receiving a sync only once
            its running request has finished, so a request may need to fit in it too.
        delta: ``"split"`` only: send each bucket as the words that changed since the replicas'
            copy (int8 steps and 16-bit offsets) when that is at most a tenth of its bytes, else in
            full (backing off for a few syncs), with the checksum of every tensor a delta updated
            verified after each sync (a mismatch is sent again in full); ``True`` or
            :class:`~rltrainer.weights.delta.DeltaSync` ``(max_share=..., checksum_every=...,
            copies=...)``. Costs one engine-dtype copy of the weights on trainer rank 0, and one
            per rollout process for engines that cannot lend their tensors (vLLM), in host memory
            unless ``copies="device"``. See :mod:`rltrainer.weights.delta`. Colocated engines
            copy each weight in place, so they sync in full.
        bucket_bytes: weight-sync bucket size; the extra memory of a sync is about one bucket
            (also the default shard size of ``Trainer.save_hf``).
    """

    def __init__(self, engine: str | RolloutEngine = "hf", placement: str = "colocated", replicas: int = 1,
                 transport: str = "auto", sync_timeout_s: float = DEFAULT_TIMEOUT_S,
                 delta: bool | DeltaSync = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r}; choose from {', '.join(PLACEMENTS)}")
        self.replicas = check_int("replicas", replicas, at_least=1, owner="Rollout",
                                  meaning="engine replicas with split placement")
        self.bucket_bytes = check_int("bucket_bytes", bucket_bytes, at_least=1, owner="Rollout",
                                      meaning="bytes of a weight-sync bucket")
        if transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"transport={transport!r}; choose from {', '.join(WEIGHT_TRANSPORTS)} "
                             "(how split placement moves weights to the rollout replicas)")
        check_sync_timeout(sync_timeout_s)
        self.engine = build_engine(engine)
        self.placement, self.transport = placement, transport
        self.sync_timeout_s = float(sync_timeout_s)
        self.delta = DeltaSync.resolve(delta)
        self.group: WorkerGroup | None = None  # the split replicas' processes, once connected
        self.remote_engine: RemoteEngine | None = None  # the controller's handle on the replicas
        self._transport: WeightTransport | None = None  # to remote_engine

    def __repr__(self) -> str:
        return (f"Rollout(engine={type(self.engine).__name__}, placement={self.placement!r}, replicas={self.replicas}, "
                f"transport={self.transport!r})")

    def connect(self, strategy: Strategy, tokenizer: Any, *, seed: int = 0, watchdog: Watchdog | None = None,
                mode: str = "wait") -> WeightSync:
        """Place and set up the engine for ``strategy`` (set up already) and return the one owner of
        its weight sync (``.engine``: the engine the controller calls), with ``watchdog`` (default:
        the strategy's) and push ``mode``. The next push sends every weight. Connecting again
        replaces the previous replicas."""
        if self.group is not None:
            self.close()
        if isinstance(strategy, WorkerGroupStrategy):
            engine, transport, view = self._connect_ranks(strategy, tokenizer, seed)
        else:
            engine, transport, view = self._connect_in_process(strategy, tokenizer)
        dog = watchdog or strategy.watchdog or Watchdog()
        return WeightSync(engine, transport, strategy, dog, mode, view=view, bucket_bytes=self.bucket_bytes)

    def _connect_in_process(self, strategy: Strategy, tokenizer: Any) -> tuple[RolloutEngine, WeightTransport, Any]:
        """The engine runs in this process, on the strategy's device; it pulls ``export_weights``."""
        engine = self.engine
        if self.placement == "split":
            raise ValueError(f"Rollout(placement='split') starts engine processes of their own beside the training "
                             f"ranks, but {type(strategy).__name__} trains in this process; use placement='colocated', "
                             "or a multi-process strategy (FSDP2Strategy(...), MegatronStrategy(...))")
        refuse_other_environment(engine, engine.runtime_env,
                                 f"in the controller's process (strategy {type(strategy).__name__})")
        device = getattr(strategy, "device", torch.device("cpu"))
        engine.check_model(strategy.model_config(), device.type)
        engine.setup(strategy.model_config(), tokenizer, device=device)
        view = enable_engine_adapters(engine, strategy.lora_config)
        strategy.set_weight_view(view)
        strategy.forget_synced(engine.weight_groups(strategy.weight_names()))
        return engine, InProcessTransport(strategy, engine), view

    def _connect_ranks(self, strategy: WorkerGroupStrategy, tokenizer: Any,
                       seed: int) -> tuple[RolloutEngine, WeightTransport, Any]:
        """Colocated: one replica in every training process. Split: ``replicas`` Ray processes of
        their own, fed by the transport ``transport`` resolves to (:meth:`_split_transport`)."""
        engine, split = self.engine, self.placement == "split"
        self._check_ranks(strategy, engine)
        group = self._start_replicas(strategy, engine, seed) if split else strategy.require_group()
        view, dtype = engine_view(strategy.lora_config, engine), getattr(engine, "dtype", None)
        if split:  # resolved, and checked with the engine, before it starts
            self._transport = self._split_transport(strategy, group, dtype)
            engine.check_split_transport(self._transport.name, adapter=view == "adapter")
        self._setup_engines(group, strategy, tokenizer, view)
        strategy.set_weight_view(view)
        strategy.require_group().remote.configure_weight_sync(self.bucket_bytes, self.delta if split else None)
        strategy.forget_synced(group.remote.engine_weight_groups(strategy.weight_names()))  # kept whole
        if split:
            group.remote.configure_delta_receiver(self.delta)
            self._transport.connect()
        else:
            self._transport = ColocatedTransport(strategy.require_group(), dtype)
        self.remote_engine = RemoteEngine(group, tokenizer, dtype, ranks_per_replica=engine.ranks_per_replica)
        self.remote_engine.return_routed_experts = engine.return_routed_experts  # what its replicas were asked
        self.remote_engine.placement = self.placement  # split replicas do not sleep while the policy trains
        return self.remote_engine, self._transport, view

    def _setup_engines(self, group: WorkerGroup, strategy: WorkerGroupStrategy, tokenizer: Any, view: Any) -> None:
        """Set the engine up in every process of ``group`` (a LoRA policy's adapter config with it if
        the engine loads adapters); a split engine of another Python environment gets the model's
        files, not objects of this environment's transformers."""
        files = self.engine.runtime_env is not None and self.placement == "split"  # another transformers, maybe
        config, lora = strategy.model_config(), strategy.lora_config if view == "adapter" else None
        if files and lora is not None:  # peft may be missing there: adapter_config.json as a dict
            lora = adapter_config_dict(lora)
        group.remote.setup_engine(self.engine, ModelFiles.of(config, tokenizer) if files else config,
                                  None if files else tokenizer, lora)

    def _check_ranks(self, strategy: WorkerGroupStrategy, engine: RolloutEngine) -> None:
        """Refuse, before any replica starts, what cannot run: the model on the ranks' devices, a
        delta to an engine that receives broadcasts itself, a colocated replica that does not fit."""
        if self.delta is not None and self.placement == "split" and engine.native_weight_broadcast:
            raise ValueError(f"Rollout(delta=...) is on, but {type(engine).__name__} receives weight broadcasts itself "
                             "(native_weight_broadcast) and cannot apply a delta; use delta=False with it, or an "
                             "engine that loads through update_weights (hf, vllm)")
        for device_type in sorted(set(strategy.require_group().remote.device_type())):  # split: the ranks' resources
            engine.check_model(strategy.model_config(), device_type)
        k = engine.ranks_per_replica
        if self.placement == "colocated":
            if strategy.world_size % k:
                raise ValueError(f"A {type(engine).__name__} replica spans {k} processes; colocated, that must "
                                 f"divide the {strategy.world_size} training ranks")
            refuse_other_environment(engine, engine.runtime_env, "colocated with the training ranks")
            if self.delta is not None:
                log.info("Rollout(delta=...): colocated engines copy each weight in place (a diff scan reads as many "
                         "bytes as that copy writes), so they sync in full")

    def _start_replicas(self, strategy: WorkerGroupStrategy, engine: RolloutEngine, seed: int) -> WorkerGroup:
        """``replicas`` engine replicas in Ray processes of their own (with the engine's Python
        environment, if it has one). One process per replica receives weights beside its
        requests; a replica spanning several (tensor parallel) receives in order with them, so all
        its ranks change weights at one point."""
        k = engine.ranks_per_replica
        group = self.group = strategy.ray_group(Worker if k == 1 else InOrderWorker, self.replicas * k, "rollout",
                                                runtime_env=engine.runtime_env)
        group.remote.seed_rng(seed + 10_000)  # the replicas sample: same seed, same run
        if k > 1:  # the replicas' processes form a torch.distributed group (vLLM's external_launcher)
            addr, port = group.remote.master_address()
            group.remote.init_distributed(addr, port)
        return group

    def _split_transport(self, strategy: WorkerGroupStrategy, rollout: WorkerGroup,
                         dtype: torch.dtype | None) -> WeightTransport:
        """``transport``, with ``"auto"`` resolved (:func:`~rltrainer.weights.transports.resolve_transport`):
        broadcast when trainer rank 0 and every replica are on GPUs (NCCL); shared memory when every
        replica is on trainer rank 0's node; else Ray's object store."""
        trainer = strategy.require_group()
        devices = {trainer.remote.device_type.on_rank_zero(), *rollout.remote.device_type()}
        same_node = set(rollout.remote.node_ip()) == {trainer.remote.node_ip.on_rank_zero()}
        name = resolve_transport(self.transport, devices, same_node)
        delta = self.delta is not None
        if name == "broadcast":
            return BroadcastTransport(trainer, rollout, dtype, get_together, timeout_s=self.sync_timeout_s, delta=delta)
        if name == "shared_memory":
            return SharedMemoryTransport(trainer, rollout, dtype, get_together, delta=delta)
        return ObjectStoreTransport(trainer, rollout, dtype, get_together, delta=delta)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The split replicas' RNG states (they sample with them, so a resumed run draws the samples
        an uninterrupted one would); empty without split replicas."""
        return {"rng": self.group.remote.rng_state()} if self.group is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of :meth:`state_dict`, if saved with as many replica processes."""
        rng = (state or {}).get("rng")
        if self.group is not None and rng and len(rng) == self.group.world_size:
            self.group.remote.set_rng_state.each([(s,) for s in rng]).get()

    def close(self) -> None:
        """Close the training ranks' end of the split replicas' transport and release the replicas
        (to connect again)."""
        if self._transport is not None:
            self._transport.close()
        self.teardown()

    def teardown(self) -> None:
        """Release the split replicas' processes (requests in flight end with them); the engine spec
        stays, to connect again."""
        if self.group is not None:
            self.group.shutdown()
        self.group = self._transport = self.remote_engine = None


def refuse_other_environment(engine: RolloutEngine, runtime_env: dict[str, Any] | None, where: str) -> None:
    """Raise if ``engine`` runs in another Python environment (its ``runtime_env``) but would be
    placed ``where`` the trainer's environment is: only processes of its own can have another."""
    if runtime_env is None:
        return
    raise ValueError(
        f"{type(engine).__name__} runs under another Python environment ({runtime_env.get('py_executable')}), "
        f"so it needs processes of its own, but it would run {where}. Use split placement, e.g. "
        "Trainer(strategy=FSDP2Strategy(devices=1), rollout=Rollout(engine=..., placement='split')), or install the "
        "engine in this environment (for vLLM: pip install -e '.[vllm]' on a GPU machine) and leave python= unset.")


def enable_engine_adapters(engine: RolloutEngine, lora_config: Any) -> str | None:
    """For a LoRA policy: give ``engine`` the adapter's config if it loads adapters; returns the
    view a sync to it uses (``"adapter"`` or ``"merged"``; ``None`` without LoRA)."""
    mode = engine_view(lora_config, engine)
    if mode == "adapter":
        engine.enable_adapters(lora_config)
    return mode


def resolve_rollout(rollout: str | RolloutEngine | Rollout) -> Rollout:
    """``rollout`` as a :class:`Rollout`: a name or an engine is ``Rollout(engine=rollout)``."""
    return rollout if isinstance(rollout, Rollout) else Rollout(engine=rollout)


def check_sync_timeout(seconds: Any) -> None:
    """Raise unless ``seconds`` is a finite number of seconds > 0 (``sync_timeout_s``)."""
    check_float("sync_timeout_s", seconds, above=0, owner="Rollout", meaning=(
        "seconds the weight broadcast group waits for its members to join and for each bucket's broadcast; raise it "
        "for slow links or large buckets, or, with SGLang (which starts receiving a sync once its running request is "
        "done), for requests that run longer"))

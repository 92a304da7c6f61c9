"""The rank-side process object. One ``Worker`` per process, created by a worker group; the
controller calls its methods by name, the weight protocol's through their typed declarations
(``@remote``, :mod:`rltrainer.controller.methods`). This base class holds the rollout role (an engine replica)
and the process setup; a Strategy's worker (e.g. ``FSDP2Worker``) adds the training role, so one
process can hold both (the colocated "hybrid engine").

A rollout process of its own (split placement) runs two threads, as Ray concurrency groups
(:attr:`Worker.concurrency_groups`): the weight-receiving methods (``@remote(thread="weights")``:
``load_bucket``, ``receive_bucket``, ``load_slot``...) in the ``"weights"`` thread, every other call
in the default one, each thread running its calls one at a
time in the order the controller sent them. A sync's buckets are staged while a request generates
and applied between two requests (:mod:`rltrainer.weights.staging`); a request waits for the
version it asks for. A training rank (:class:`~rltrainer.strategies.rank_worker.TrainingWorker`)
and a replica spanning several processes (:class:`InOrderWorker`) run every call in one thread, in
order.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from rltrainer.controller.methods import RANK_ZERO, remote
from rltrainer.rollout.engine import Generation, ModelFiles, RolloutEngine, SamplingParams
from rltrainer.weights.delta import DeltaSync
from rltrainer.weights.receiver import WeightReceiver
from rltrainer.weights.staging import EngineGate
from rltrainer.weights.wire import Bucket, Encoding, Entry

WEIGHTS_GROUP = "weights"  # the Ray concurrency group (thread) that receives weights
Stats = dict[str, float]
#: a weight-receiving method: the watchdog's stage ``<group>.receive_weights``, in the weights thread
receives = remote(stage="receive_weights", thread=WEIGHTS_GROUP)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class Worker:
    """Args:
        rank / world_size: this process's place in its group.
        threads: ``torch.set_num_threads`` for this process (CPU ranks should not oversubscribe).
        device: ``"auto"`` (this process's GPU if it has one, else CPU), or an explicit device.
    """

    #: Ray concurrency groups (name: threads) its actor is created with, besides the default one;
    #: a remote method marked with one (``@remote(thread=...)``) runs there.
    concurrency_groups: ClassVar[dict[str, int]] = {WEIGHTS_GROUP: 1}

    def __init__(self, rank: int, world_size: int, threads: int | None = None, device: str = "auto") -> None:
        self.rank, self.world_size = rank, world_size
        if threads:
            torch.set_num_threads(threads)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.engine: RolloutEngine | None = None
        self.gate = EngineGate()  # one engine call at a time; syncs applied between requests
        self.receiver = WeightReceiver(self.device, self.gate)
        self._own_process_group = False

    @remote
    def pid(self) -> int:
        return os.getpid()

    @remote
    def python(self) -> str:
        """This process's interpreter (an engine may run another Python environment's)."""
        return sys.executable

    @remote
    def device_type(self) -> str:
        return self.device.type

    @remote
    def seed_rng(self, seed: int) -> None:
        """Seed this process's torch RNG with ``seed + rank`` (what its engine samples with)."""
        torch.manual_seed(seed + self.rank)

    @remote
    def rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    @remote
    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    # -- torch.distributed ---------------------------------------------------------------------
    @remote
    def node_ip(self) -> str:
        try:
            import ray

            return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        except Exception:  # not under Ray
            return "127.0.0.1"

    @remote(RANK_ZERO)
    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port (asked of rank 0 before ``init_distributed``)."""
        return self.node_ip(), _free_port()

    @remote
    def init_distributed(self, master_addr: str, master_port: int, timeout_s: float = 1800.0) -> None:
        """Join the group's torch.distributed process group: gloo on CPU, NCCL on GPU (this rank's
        GPU made the current device first: NCCL's barrier and object collectives use that one).
        Collectives over host data take :func:`~rltrainer.process_groups.host_group`."""
        import torch.distributed as dist

        if dist.is_initialized():  # e.g. a user-launched group in this process
            return
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                    world_size=self.world_size, timeout=timeout)
        self._own_process_group = True

    @remote
    def destroy_distributed(self) -> None:
        import torch.distributed as dist

        if self._own_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_process_group = False

    # -- rollout role ----------------------------------------------------------------------------
    @remote
    def setup_engine(self, engine: RolloutEngine, model_config: Any, tokenizer: Any = None,
                     lora_config: Any = None) -> None:
        """Set up ``engine`` here; with ``lora_config``, also ready it for that adapter (``enable_adapters``).
        ``model_config`` may be :class:`~rltrainer.rollout.engine.ModelFiles` (config and tokenizer
        as files, for a process in another Python environment)."""
        if isinstance(model_config, ModelFiles):
            model_config, tokenizer = model_config.load()
        engine.setup(model_config, tokenizer, device=self.device)
        if lora_config is not None:
            engine.enable_adapters(lora_config)
        self.engine = engine

    def _require_engine(self) -> RolloutEngine:
        if self.engine is None:
            raise RuntimeError(f"Worker rank {self.rank} holds no rollout engine (setup_engine was not called)")
        return self.engine

    @remote
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, min_version: int = -1) -> Generation:
        """Generate with weight version ``min_version`` or later (the version the controller had
        started pushing when it sent the request: waited for if it has not arrived yet, where
        weights arrive in a thread of their own); the result says which version it used."""
        engine = self._require_engine()
        wait_for = min_version if WEIGHTS_GROUP in self.concurrency_groups else -1  # in order: pushes sent before ran
        with self.gate.use(engine, wait_for):
            version = engine.weight_version
            generation = engine.generate(prompts, sampling)
        if version >= 0:  # the version of the weights it generated with
            generation.weight_version = version
        return generation

    @remote
    def prompt_log_probs(self, prompt: list[int], min_version: int = -1) -> list[float | None]:
        """The engine's :meth:`~rltrainer.rollout.engine.RolloutEngine.prompt_log_probs`, with weight
        version ``min_version`` or later (as :meth:`generate`)."""
        engine = self._require_engine()
        wait_for = min_version if WEIGHTS_GROUP in self.concurrency_groups else -1
        with self.gate.use(engine, wait_for):
            return engine.prompt_log_probs(prompt)

    @receives
    def hold_weights(self, version: int) -> None:
        """A rollout assigned weight version ``version`` is coming: apply no newer sync until
        :meth:`release_weights` (in the weights thread: in place before a later sync's buckets)."""
        self.gate.hold(version)

    @remote
    def release_weights(self, version: int) -> None:
        """The rollout that held ``version`` is over (in the requests' thread, after its requests)."""
        self.gate.release_hold(version)

    @remote
    def engine_sleep(self, level: int = 1) -> None:
        with self.gate.use(self._require_engine()) as engine:
            engine.sleep(level)

    @remote
    def engine_wake_up(self) -> None:
        with self.gate.use(self._require_engine()) as engine:
            engine.wake_up()

    @remote
    def engine_teardown(self) -> None:
        self.receiver.close(self.engine)
        if self.engine is not None:
            self.engine.teardown()
            self.engine = None

    # -- weights: the receiving side of rltrainer.weights' transports ------------------------------
    # (each runs :class:`~rltrainer.weights.receiver.WeightReceiver` on this process's engine)
    @receives
    def load_bucket(self, bucket: Bucket, version: int | None = None, index: int = 0, count: int = 1) -> Stats:
        """Bucket ``index`` of ``count`` of sync ``version`` as a value (``None``: loaded now, outside a sync)."""
        return self.receiver.load(self._require_engine(), bucket, version, index, count)

    @receives
    def commit_weights(self, version: int) -> Stats:
        """A sync with nothing to send: the engine still takes ``version``."""
        return self.receiver.commit(self._require_engine(), version)

    @receives
    def take_weights_discarded(self) -> bool:
        """Whether a sleep discarded the engine's weights (the flag is reset)."""
        return self.receiver.take_weights_discarded(self._require_engine())

    @receives
    def weight_group_ranks(self) -> int:
        """Ranks this process's engine takes in the broadcast group."""
        return self.receiver.group_ranks(self._require_engine())

    @receives
    def join_weight_group(self, address: str, port: int, world_size: int, group_name: str, backend: str,
                          timeout_s: float, rank_offset: int) -> None:
        """Join the broadcast group trainer rank 0 hosts, as ranks ``rank_offset ..``."""
        self.receiver.join_group(self._require_engine(), address, port, world_size, group_name, backend, timeout_s,
                                 rank_offset)

    @receives
    def receive_bucket(self, entries: Sequence[Entry], version: int, index: int, count: int,
                       encoding: Encoding | None = None) -> Stats:
        """Broadcast bucket ``index`` of ``count`` of sync ``version`` (coded as ``encoding`` with delta sync)."""
        return self.receiver.receive(self._require_engine(), entries, version, index, count, encoding)

    @receives
    def configure_delta_receiver(self, settings: DeltaSync | None) -> None:
        """Delta sync on (``settings``: where its mirror and staged buckets are kept) or off."""
        self.receiver.configure_delta(settings)

    @receives
    def repair_weights(self, buckets: list[Bucket], version: int) -> Stats:
        """Delta sync: buckets of sync ``version`` whose checksums did not match, again in full."""
        return self.receiver.repair(self._require_engine(), buckets, version)

    @receives
    def open_weight_slots(self, paths: list[str], nbytes: int) -> None:
        """Map trainer rank 0's two shared-memory slots."""
        self.receiver.open_slots(self._require_engine(), paths, nbytes)

    @receives
    def load_slot(self, index: int, entries: Sequence[Entry], ready: Any, version: int, count: int) -> Stats:
        """Bucket ``index`` of ``count`` of sync ``version`` from its slot, once ``ready`` (rank 0's write)."""
        return self.receiver.load_slot(self._require_engine(), index, entries, ready, version, count)

    @remote(RANK_ZERO)
    def engine_weight_groups(self, names: list[str]) -> list[list[str]]:
        """The weight names this process's engine must receive together (``RolloutEngine.weight_groups``)."""
        return self._require_engine().weight_groups(names)

    @remote
    def engine_weight_version(self) -> int:
        """The version of the last sync this process's engine loaded completely (-1: none yet)."""
        return self._require_engine().weight_version

    @remote
    def engine_weight_digests(self) -> dict[str, str] | None:
        """The engine's digests of the weights it holds (``RolloutEngine.weight_digests``), between two requests."""
        with self.gate.use(self._require_engine()) as engine:
            return engine.weight_digests()

    @remote
    def engine_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the engine's parameters (for checks and debugging)."""
        with self.gate.use(self._require_engine()) as engine:
            model = getattr(engine, "model", None)
            if model is None:
                raise RuntimeError(f"{type(engine).__name__} exposes no .model to read weights from")
            return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


class InOrderWorker(Worker):
    """A rollout process of a replica that spans several (vLLM's tensor-parallel ranks under
    ``external_launcher``): it receives weights in order with its requests, one call at a time, so
    every rank of the replica changes weights between the same two requests. Its pushes wait for
    the requests sent before them."""

    concurrency_groups: ClassVar[dict[str, int]] = {}

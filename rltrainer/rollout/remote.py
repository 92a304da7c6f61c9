"""The controller's handle on engine replicas that live in worker processes.

:class:`RemoteEngine` is a :class:`RolloutEngine`, so ``rollout_step`` cannot tell it from a
local one: ``generate`` splits the prompts across the replicas (all samples of a prompt stay on
one replica) and concatenates their results in prompt order. ``generate`` may be called from
several controller threads at once (the async pipelines do); ``replica(i)`` is a view that sends
to one replica only.

A request asks its replicas for the controller's ``weight_version`` when it is sent (the version
of the last push started): a replica generates with that version or a later one, waiting for it
if its push has not arrived yet, and never changes weights inside a request. Pushes are not held
up by requests, nor requests by pushes (:mod:`rltrainer.weights.staging`). A replica that spans
several processes (vLLM's tensor-parallel ranks, :class:`~rltrainer.rollout.worker.InOrderWorker`)
runs pushes and requests in one order, the same on each of its ranks (the worker group submits a
call to all its ranks as one): there a push waits for the request sent before it, on every rank, and
the request sent after it for the push. The replicas report the version they used, and the result
carries it (per row where replicas differ); ranks of one replica that disagree raise.

A seeded run's pipeline assigns each rollout its version instead (:mod:`rltrainer.pipelines`):
:meth:`RemoteEngine.hold` keeps newer weights out of the replicas until :meth:`RemoteEngine.release`,
and the view :meth:`RemoteEngine.at_version` asks for exactly that version.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from rltrainer.controller.methods import method_threads
from rltrainer.rollout.engine import Generation, RolloutEngine, SamplingParams
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES, Bucket, bucketed


class RemoteEngine(RolloutEngine):
    """Engine replicas in the workers of ``group`` (already set up by the strategy): one per
    ``ranks_per_replica`` consecutive workers.

    Args:
        group: the worker group whose workers hold the replicas (``Worker.setup_engine`` done).
        tokenizer: the tokenizer the replicas use.
        dtype: the replicas' weight dtype (weights are cast to it before they are sent).
        ranks_per_replica: workers one replica spans (vLLM's tensor-parallel ranks under
            ``external_launcher``): they all get the replica's prompts, the first one's output is used.
    """

    def __init__(self, group: Any, tokenizer: Any, dtype: torch.dtype | None = None,
                 ranks_per_replica: int = 1, trainer_log_probs: bool = False) -> None:
        if ranks_per_replica < 1 or group.world_size % ranks_per_replica:
            raise ValueError(f"An engine replica spanning {ranks_per_replica} processes does not tile the "
                             f"{group.world_size} processes of worker group {getattr(group, 'name', '?')!r}")
        self.group = group
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.ranks_per_replica_ = ranks_per_replica
        self.trainer_log_probs = trainer_log_probs
        self.placement = "colocated"  # "split": replicas in processes of their own (Rollout.connect sets it)
        self.replica_ids = list(range(group.world_size // ranks_per_replica))
        self._state = _Shared()
        self._version: int | None = None  # a view's fixed version (at_version), else the last push started

    @property  # type: ignore[override]
    def weight_version(self) -> int:
        return self._state.version if self._version is None else self._version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self._state.version = version

    @property  # type: ignore[override]
    def weights_discarded(self) -> bool:
        """Whether a :meth:`sleep` discarded a replica's weights since the last sync started."""
        return self._state.weights_discarded

    @weights_discarded.setter
    def weights_discarded(self, discarded: bool) -> None:
        self._state.weights_discarded = discarded

    def replica(self, index: int) -> RemoteEngine:
        """A view that sends ``generate`` to replica ``index`` only (same lock and version)."""
        view = object.__new__(RemoteEngine)
        view.__dict__.update(self.__dict__)
        view.replica_ids = [self.replica_ids[index]]
        return view

    def at_version(self, version: int) -> RemoteEngine:
        """A view whose requests ask for weight version ``version`` exactly (held, see :meth:`hold`):
        its results say so, or raise if a replica used another."""
        view = object.__new__(RemoteEngine)
        view.__dict__.update(self.__dict__)
        view._version = version
        return view

    @property
    def holds_versions(self) -> bool:
        """Whether the replicas can keep newer weights out while a rollout of an older version runs
        (:meth:`hold`): one process per replica that receives in a thread of its own. A replica spanning
        several processes receives in order with its requests: its pushes must wait for them."""
        return "hold_weights" in method_threads(self.group.worker_cls)

    def hold(self, version: int) -> Callable[[], Any]:
        """Keep weights newer than ``version`` out of this view's replicas until :meth:`release` (a
        rollout of ``version`` is coming). Returns at once, with a function that waits until the
        holds are in place (before a push of anything newer starts)."""
        ranks = self._ranks()
        futures = self.group._call_async(ranks, "hold_weights", [((version,), {})] * len(ranks))
        return functools.partial(self.group.get, futures, "hold_weights")

    def release(self, version: int) -> None:
        """End a :meth:`hold`, after the rollout's last request. Returns at once: the call runs in the
        replicas' request thread, in the order sent (after that request, before the next one)."""
        ranks = self._ranks()
        self.group._call_async(ranks, "release_weights", [((version,), {})] * len(ranks))

    def _ranks(self) -> list[int]:
        k = self.ranks_per_replica_
        return [rank for replica in self.replica_ids for rank in range(replica * k, (replica + 1) * k)]

    @property
    def ranks_per_replica(self) -> int:
        return self.ranks_per_replica_

    @property
    def replicas(self) -> int:
        return len(self.replica_ids)

    def setup(self, model_config: Any, tokenizer: Any, device: torch.device | str | None = None) -> None:
        raise RuntimeError("RemoteEngine replicas are set up by their rollout (Rollout.connect)")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Generation:
        return self.generate_async(prompts, sampling).result()

    def generate_async(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Future:
        """Submit the request and return at once: a ``concurrent.futures.Future`` of the
        :class:`Generation` (a failed or dead replica: its ``WorkerError``). The controller can
        train meanwhile; pushes submitted after this call land after the request.

        With a seed, the replica whose share starts at prompt ``i`` gets ``seed + i * n``: vLLM and
        SGLang then draw every sample with the seed one engine would give it (``seed + i * n + j``),
        and no two replicas share a seed."""
        shares = np.array_split(np.arange(len(prompts)), self.replicas)
        k = self.ranks_per_replica_
        ranks, calls = [], []
        for replica, idx in zip(self.replica_ids, shares):
            if not len(idx):
                continue
            seed = None if sampling.seed is None else sampling.seed + int(idx[0]) * sampling.n
            call = (([list(prompts[i]) for i in idx], dataclasses.replace(sampling, seed=seed)), {})
            ranks.extend(range(replica * k, (replica + 1) * k))  # every rank of the replica, same call
            calls.extend([call] * k)
        with self._state.lock:  # versions asked in the order sent (the group gives every rank one order)
            version = self.weight_version
            calls = [(args, {"min_version": version}) for args, _ in calls]
            futures = self.group._call_async(ranks, "generate", calls)
        result: Future = Future()
        threading.Thread(target=self._collect, args=(futures, ranks, version, result), daemon=True,
                         name="rltrainer-generate").start()
        return result

    def _collect(self, futures: list[Any], ranks: list[int], version: int, result: Future) -> None:
        try:
            outputs = self.group.get(futures, "generate")
            k = self.ranks_per_replica_
            for first in range(0, len(outputs), k):  # a replica's ranks hold shards of one model
                versions = [o.weight_version for o in outputs[first:first + k]]
                if len(set(versions)) > 1:
                    raise RuntimeError(f"The ranks {ranks[first:first + k]} of one replica generated with weight "
                                       f"versions {versions}: they took a push and this request in different orders, "
                                       "so the request ran on shards of several versions")
            parts = outputs[::k]  # each replica's first rank
            generation = concat_generations(parts, self.tokenizer)
            used = [p.weight_version if p.weight_version is not None else version for p in parts]
            exact = self._version is not None  # a scheduled request: that version and no other
            if any(v < version for v in used) or (exact and set(used) != {version}):
                raise RuntimeError(f"Replicas {ranks} generated with weight versions {used} for a request that asked "
                                   f"for version {version}{' or later' * (not exact)} (the replicas lost a push"
                                   f"{', or applied a newer one past a hold' * exact})")
            generation.weight_version = min(used)  # the replicas say which weights they used
            if len(set(used)) > 1:  # a push landed on one replica before the request started there
                generation.row_weight_versions = torch.tensor(
                    [v for v, p in zip(used, parts) for _ in range(p.response_ids.shape[0])], dtype=torch.long)
            result.set_result(generation)
        except BaseException as exc:  # the caller's result() raises it
            result.set_exception(exc)

    def prompt_log_probs(self, prompt: Sequence[int]) -> list[float | None]:
        """Scored by the first replica (all its ranks get the call; its first rank's answer is used)."""
        k = self.ranks_per_replica_
        ranks = list(range(self.replica_ids[0] * k, (self.replica_ids[0] + 1) * k))
        with self._state.lock:
            call = ((list(prompt),), {"min_version": self.weight_version})
            futures = self.group._call_async(ranks, "prompt_log_probs", [call] * len(ranks))
        return self.group.get(futures, "prompt_log_probs")[0]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Send ``(hf_name, tensor)`` pairs from this process to every replica, bucket by bucket (the
        replicas' ``weight_version`` stays: these are not a sync of the policy)."""
        count = nbytes = 0
        buckets = list(bucketed(weights, DEFAULT_BUCKET_BYTES))  # references: each is copied when packed
        for index, bucket in enumerate(buckets):  # one update session on the replicas, over all buckets
            stats = self.group.remote.load_bucket(Bucket.pack(bucket), None, index, len(buckets))[0]
            count += stats["tensors"]
            nbytes += stats["bytes"]
        return {"tensors": count, "bytes": nbytes}

    def engine_weight_versions(self) -> list[int]:
        """Each worker's ``weight_version``, as its engine reports it."""
        return self.group.remote.engine_weight_version()

    def sleep(self, level: int = 1) -> None:
        self.group.remote.engine_sleep(level)
        if level >= 2:  # level 1 keeps the weights; at level 2 the replicas say whether theirs survived
            if any(self.group.remote.take_weights_discarded()):
                self.weights_discarded = True

    def wake_up(self) -> None:
        self.group.remote.engine_wake_up()

    def teardown(self) -> None:
        try:
            self.group.remote.engine_teardown()
        except Exception:  # the group may be gone already
            pass


class _Shared:
    """What the views of one RemoteEngine share: the lock requests are sent under, the weight
    version, and whether a sleep discarded the replicas' weights."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = -1
        self.weights_discarded = False


def concat_generations(parts: Sequence[Generation], tokenizer: Any) -> Generation:
    """One :class:`Generation` from replicas' parts, right-padding responses to the longest."""
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = pad_id if pad_id is not None else 0
    width = max(p.response_ids.shape[1] for p in parts)

    def padded(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    metrics: dict[str, float] = {}
    for p in parts:
        for k, v in p.metrics.items():
            # replicas run side by side: times are the slowest replica's, counts and rates add up
            metrics[k] = max(metrics.get(k, v), v) if k.endswith("time_s") else metrics.get(k, 0.0) + v
    return Generation(
        response_ids=torch.cat([padded(p.response_ids, pad_id) for p in parts]),
        response_mask=torch.cat([padded(p.response_mask, 0) for p in parts]),
        log_probs=torch.cat([padded(p.log_probs, 0.0) for p in parts]),
        text=[t for p in parts for t in p.text],
        finish_reason=[r for p in parts for r in p.finish_reason],
        metrics=metrics,
        routed_experts=(None if any(p.routed_experts is None for p in parts)
                        else [r for p in parts for r in p.routed_experts]),
    )

"""The controller's handle on engine replicas that live in worker processes.

:class:`RemoteEngine` is a :class:`RolloutEngine`, so ``rollout_step`` cannot tell it from a
local one: ``generate`` splits the prompts across the replicas (all samples of a prompt stay on
one replica) and concatenates their results in prompt order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

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
                 ranks_per_replica: int = 1) -> None:
        if ranks_per_replica < 1 or group.world_size % ranks_per_replica:
            raise ValueError(f"An engine replica spanning {ranks_per_replica} processes does not tile the "
                             f"{group.world_size} processes of worker group {getattr(group, 'name', '?')!r}")
        self.group = group
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.ranks_per_replica_ = ranks_per_replica

    @property
    def ranks_per_replica(self) -> int:
        return self.ranks_per_replica_

    @property
    def replicas(self) -> int:
        return self.group.world_size // self.ranks_per_replica_

    def setup(self, model_config: Any, tokenizer: Any, device: torch.device | str | None = None) -> None:
        raise RuntimeError("RemoteEngine replicas are set up by their strategy (Strategy.connect_engine)")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Generation:
        shares = np.array_split(np.arange(len(prompts)), self.replicas)
        k = self.ranks_per_replica_
        ranks, calls = [], []
        for replica, idx in enumerate(shares):
            if not len(idx):
                continue
            seed = None if sampling.seed is None else sampling.seed + replica
            call = (([list(prompts[i]) for i in idx], dataclasses.replace(sampling, seed=seed)), {})
            ranks.extend(range(replica * k, (replica + 1) * k))  # every rank of the replica, same call
            calls.extend([call] * k)
        outputs = self.group.get(self.group._call_async(ranks, "generate", calls), "generate")
        return concat_generations(outputs[::k], self.tokenizer)  # each replica's first rank

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Send ``(hf_name, tensor)`` pairs from this process to every replica, bucket by bucket (the
        replicas' ``weight_version`` stays: these are not a sync of the policy)."""
        count = nbytes = 0
        for bucket in bucketed(weights, DEFAULT_BUCKET_BYTES):
            stats = self.group.execute_all("receive_weights", "load", Bucket.pack(bucket), None)[0]
            count += stats["tensors"]
            nbytes += stats["bytes"]
        return {"tensors": count, "bytes": nbytes}

    def engine_weight_versions(self) -> list[int]:
        """Each worker's ``weight_version``, as its engine reports it."""
        return self.group.execute_all("engine_weight_version")

    def sleep(self, level: int = 1) -> None:
        self.group.execute_all("engine_sleep", level)

    def wake_up(self) -> None:
        self.group.execute_all("engine_wake_up")

    def teardown(self) -> None:
        try:
            self.group.execute_all("engine_teardown")
        except Exception:  # the group may be gone already
            pass


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
    )

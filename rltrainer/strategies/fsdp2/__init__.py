"""FSDP2 strategy: ``torch.distributed.fsdp.fully_shard`` over ``devices x num_nodes`` ranks.

The controller (this process) holds :class:`FSDP2Strategy`; the ranks are :class:`FSDP2Worker`
objects, Ray actors when there is more than one rank, or one in-process worker otherwise (no
Ray, so breakpoints work). The controller splits each batch across the data-parallel ranks,
balanced by token count, with the same number of micro-batches on every rank (FSDP's collectives
must match); a rank short of rows runs a zero-weight padding micro-batch.

``configure_model`` builds on the meta device and each rank loads only its rows once the model is
sharded: from a checkpoint's safetensors files (no rank ever holds the whole model), or, for a
random init, from rank 0, the one rank that runs it whole (see :meth:`FSDP2Worker.setup`).

Gradients are summed across ranks, not averaged: ``policy_step`` normalises by the global token
or row count in ``micro_batch.global_tokens`` / ``global_rows``, so a 2-rank step equals a 1-rank step.

Where each job lives:

- :mod:`~rltrainer.strategies.fsdp2.strategy`: :class:`FSDP2Strategy`, the controller side.
- :mod:`~rltrainer.strategies.fsdp2.worker`: :class:`FSDP2Worker`, the rank side (setup, gathering
  weights for a sync, sharded checkpoints).
- :mod:`~rltrainer.strategies.fsdp2.sharding`: ``fully_shard`` a model, fill a rank's rows, measure a shard.
- :mod:`~rltrainer.strategies.fsdp2.checkpoint`: a rank's shards of a checkpoint any number of
  ranks loads (``torch.distributed.checkpoint``, read without unpickling).
"""

from rltrainer.strategies.fsdp2.strategy import FSDP2Strategy
from rltrainer.strategies.fsdp2.worker import FSDP2Worker

__all__ = ["FSDP2Strategy", "FSDP2Worker"]

"""Where the two sides of a multi-process strategy used to live together; kept so old imports work.

The rank side is :mod:`rltrainer.strategies.rank_worker` (:class:`TrainingWorker`); the
controller side, with the batch dispatch, is :mod:`rltrainer.strategies.dispatch`
(:class:`WorkerGroupStrategy`, :func:`partition_for_ranks`).
"""

from rltrainer.strategies.dispatch import WorkerGroupStrategy, partition_for_ranks, ship_user_code
from rltrainer.strategies.rank_worker import TrainingWorker

__all__ = ["TrainingWorker", "WorkerGroupStrategy", "partition_for_ranks", "ship_user_code"]

"""The single controller's handles on worker processes: Ray worker groups (placement groups,
typed dispatch, failure reporting) and the in-process equivalent. The process object a group
creates (:class:`~rltrainer.rollout.worker.Worker`) lives with the rollout side."""

from rltrainer.controller.errors import WorkerError
from rltrainer.controller.worker_group import InProcessWorkerGroup, RayWorkerGroup, WorkerGroup

__all__ = ["InProcessWorkerGroup", "RayWorkerGroup", "WorkerError", "WorkerGroup"]

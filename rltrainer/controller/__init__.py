"""The single controller's handles on worker processes: Ray worker groups (placement groups,
typed dispatch, failure reporting) and the in-process equivalent. The process object a group
creates (:class:`~rltrainer.rollout.worker.Worker`) lives with the rollout side."""

from rltrainer.controller.worker_group import InProcessWorkerGroup, RayWorkerGroup, WorkerError, WorkerGroup

__all__ = ["InProcessWorkerGroup", "RayWorkerGroup", "WorkerError", "WorkerGroup"]

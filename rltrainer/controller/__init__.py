"""The single controller's handles on worker processes: Ray worker groups (placement groups,
typed dispatch, failure reporting) and the in-process equivalent."""

from rltrainer.controller.worker import Worker
from rltrainer.controller.worker_group import InProcessWorkerGroup, RayWorkerGroup, WorkerError, WorkerGroup

__all__ = ["InProcessWorkerGroup", "RayWorkerGroup", "Worker", "WorkerError", "WorkerGroup"]

"""The error a worker group raises when one of its workers fails (the watchdog's timeouts are one)."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker raised or died while running a method."""

    def __init__(self, group: str, rank: int, method: str, detail: str, headline: str | None = None) -> None:
        self.group, self.rank, self.method, self.detail = group, rank, method, detail
        super().__init__(f"{headline or f'Worker {group}[rank {rank}] failed in {method}():'}\n{detail}")

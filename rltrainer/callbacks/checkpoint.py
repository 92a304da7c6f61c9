"""Periodic checkpoints: ``ModelCheckpoint(every_n_steps=50)`` writes the checkpoint directories
``step=N.ckpt`` and the symlink ``last.ckpt`` under ``dirpath`` (default
``<default_root_dir>/checkpoints``); ``fit(ckpt_path="last")`` resumes from there. Each appears only
once complete, and ``last`` moves in one rename (:mod:`rltrainer.checkpoints`).

With ``monitor`` (Lightning's ``monitor`` / ``mode`` / ``save_top_k``), the run also keeps its best
``save_top_k`` checkpoints by that metric, e.g. ``ModelCheckpoint(monitor="val/accuracy",
mode="max")``: a step whose validation scores among the best so far is saved (whether or not it is an
``every_n_steps`` step), and a checkpoint leaves only when it is neither among the newest ``keep``
nor among the best. The scores travel in each checkpoint's ``trainer.pt`` (checksummed with it), so
a resumed run goes on ranking the checkpoints it wrote before.

A run never replaces another run's checkpoints: one that resumes from a run's newest checkpoint goes
on in its directory; one that starts from scratch (or from an older checkpoint) where ``dirpath``
already holds checkpoints writes to ``<dirpath>-2`` (``-3``...) instead, and says so.
``ckpt_path="last"`` takes the newest of them."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltrainer.callbacks.callback import Callback
from rltrainer.checkpoints import (CheckpointError, clean_leftovers, dangling_last, find_last, find_last_run,
                                   fresh_run_directory, is_complete, point_last, remove_checkpoint, run_directories,
                                   step_checkpoints)
from rltrainer.files import check_writable
from rltrainer.values import check_int

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer

log = logging.getLogger(__name__)


class ModelCheckpoint(Callback):
    """Save every ``every_n_steps`` steps and at the end of fit; keep the newest ``keep``, and with
    ``monitor`` also the best ``save_top_k`` by that metric.

    Args:
        dirpath: where checkpoints go (default ``<default_root_dir>/checkpoints``); ``fit(ckpt_path="last")``
            looks here (and in the ``<dirpath>-N`` of runs started beside it).
        every_n_steps: save after every N-th step.
        save_last: keep ``last.ckpt`` pointing at the newest checkpoint, and save at the end of fit.
        keep: how many of this run's newest ``step=N.ckpt`` to keep (the oldest are deleted once a newer
            one is complete; a resumed run goes on pruning those it wrote before; another run's are never
            deleted).
        async_save: write in the background while training goes on (``fsdp2``; see
            :meth:`Trainer.save_checkpoint`): the checkpoint, ``last`` and the deletions follow when it
            is complete, at the next save or the end of fit.
        monitor: a metric of the step or of its validation (``"val/accuracy"``, ``"val/score"``,
            ``"critic/score/mean"``): also keep the ``save_top_k`` checkpoints where it was best. A step
            where it is computed and ranks among the best so far is saved, an ``every_n_steps`` step or
            not (with the validation of ``val_check_interval`` and at the end of fit, where it ran). A
            ``val/`` name that validation does not log raises, listing those it logs. ``None``: only
            the newest ``keep``.
        mode: ``"max"`` (higher is better: accuracy, score) or ``"min"`` (a loss); Lightning's default,
            ``"min"``.
        save_top_k: how many of the best checkpoints by ``monitor`` to keep, besides the newest ``keep``.

    After a checkpoint is saved, :attr:`best_model_path` and :attr:`best_model_score` are the best so far
    (as in Lightning).
    """

    def __init__(self, dirpath: str | Path | None = None, every_n_steps: int = 100, save_last: bool = True,
                 keep: int = 1, async_save: bool = False, monitor: str | None = None, mode: str = "min",
                 save_top_k: int = 1) -> None:
        every_n_steps = check_int("every_n_steps", every_n_steps, at_least=1, owner="ModelCheckpoint")
        keep = check_int("keep", keep, at_least=1, meaning="how many step=N.ckpt to keep", owner="ModelCheckpoint")
        save_top_k = check_int("save_top_k", save_top_k, at_least=1, owner="ModelCheckpoint",
                               meaning="how many of the best checkpoints by monitor to keep")
        self._check_ranking(monitor, mode, save_top_k)
        self.dirpath = Path(dirpath) if dirpath else None
        self.every_n_steps, self.save_last, self.keep, self.async_save = every_n_steps, save_last, keep, async_save
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        self._saved: list[Path] = []
        self._run_dir: Path | None = None  # during and after fit: where this run writes
        self._saved_step: int | None = None
        self._scores: dict[str, float] = {}  # this run's checkpoints (by name) and their monitored value
        self._loaded_scores: dict[str, float] = {}  # as the checkpoint a resume loaded recorded them
        self._fresh: tuple[int, float] | None = None  # (step, value) the monitored metric was last computed at

    @staticmethod
    def _check_ranking(monitor: str | None, mode: str, save_top_k: int) -> None:
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ValueError(f"monitor must be a metric's name (e.g. 'val/accuracy') or None, got {monitor!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' (lower is better, a loss) or 'max' (higher is better, an "
                             f"accuracy), got {mode!r}")
        if monitor is None and save_top_k != 1:
            raise ValueError(f"save_top_k={save_top_k} keeps the best checkpoints by a metric, but monitor is None. "
                             "Name the metric (e.g. monitor='val/accuracy', mode='max'), or use keep=N for the "
                             "newest N checkpoints.")

    @property
    def best_model_path(self) -> Path | None:
        """This run's best checkpoint by ``monitor`` so far (``None`` before one is scored)."""
        best = self._ranked()[:1]
        return self._run_dir / best[0] if best and self._run_dir is not None else None

    @property
    def best_model_score(self) -> float | None:
        """Its ``monitor`` value."""
        best = self._ranked()[:1]
        return self._scores[best[0]] if best else None

    def checkpoint_dir(self, trainer: Trainer) -> Path:
        """Where ``fit(ckpt_path="last")`` looks (with the runs beside it), and a first run writes."""
        return self.dirpath or Path(trainer.default_root_dir) / "checkpoints"

    def run_dir(self, trainer: Trainer) -> Path:
        """Where this run writes: :meth:`checkpoint_dir`, unless it holds another run's checkpoints."""
        return self._run_dir or self.checkpoint_dir(trainer)

    def on_fit_start(self, trainer: Trainer, module: RLModule) -> None:
        base, resumed = self.checkpoint_dir(trainer), trainer.ckpt_path
        check_writable(base, "ModelCheckpoint" + (f"(dirpath={str(self.dirpath)!r})" if self.dirpath else
                                                  f" (default_root_dir={trainer.default_root_dir!r} + checkpoints)"))
        for directory in run_directories(base):  # deletions a crash interrupted: already decided
            clean_leftovers(directory)
        newest = {last.resolve(): d for d in run_directories(base) if (last := find_last(d)) is not None}
        if resumed is not None and resumed.resolve() in newest:  # a run's newest: it goes on where it was
            self._run_dir, self._saved_step = newest[resumed.resolve()], trainer.global_step
            self._saved = self._written_before(self._run_dir)
            self._scores = {p.name: self._loaded_scores[p.name] for p in self._saved if p.name in self._loaded_scores}
        elif resumed is None and self._run_dir is not None:
            return  # fit() again in this process: the same run
        else:
            self._run_dir, self._saved, self._saved_step = fresh_run_directory(base), [], None
            self._scores = {}
            if self._run_dir != base:
                log.warning("%s holds the checkpoints of an earlier run; this run starts %s and writes its "
                            "checkpoints to %s beside them, which stay as they are. To resume the newest run "
                            "instead, pass ckpt_path='last' (command line: --ckpt_path last).", base,
                            f"from {resumed}" if resumed else "from scratch", self._run_dir)

    @staticmethod
    def _written_before(run_dir: Path) -> list[Path]:
        """The checkpoints of the run in ``run_dir`` (it resumes), oldest first, to prune as it goes on;
        those left incomplete (a crash mid-save or mid-delete of an older rltrainer) are removed."""
        clean_leftovers(run_dir, temporary=True)
        saved = []
        for _, path in step_checkpoints(run_dir):
            if is_complete(path):
                saved.append(path)
            else:
                log.info("Removing %s: an incomplete checkpoint (a save or deletion that did not finish)", path)
                remove_checkpoint(path)
        return saved

    def on_step_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        if self.monitor is not None and self.monitor in metrics:  # a step metric, or val/ of this step's validation
            self._fresh = (trainer.global_step, float(metrics[self.monitor]))
        if trainer.global_step % self.every_n_steps == 0 or self._ranks_among_best(trainer.global_step):
            self.save(trainer)

    def on_validation_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        if self.monitor is None:
            return
        if self.monitor not in metrics:
            if self.monitor.startswith("val/"):
                raise ValueError(f"ModelCheckpoint(monitor={self.monitor!r}): validation logged no such metric; it "
                                 f"logged {', '.join(sorted(metrics)) or 'nothing'}. Monitor one of them.")
            return
        step, name = trainer.global_step, f"step={trainer.global_step}.ckpt"
        self._fresh = (step, float(metrics[self.monitor]))
        if self._saved_step == step and name not in self._scores:  # saved before this validation (the end of fit):
            self._scores[name] = self._fresh[1]  # ranked now, and saved again with its score if save_last
            self._saved_step = None

    def on_fit_end(self, trainer: Trainer, module: RLModule) -> None:
        if self.save_last:
            self.save(trainer)
        if self.monitor is None:
            return
        if self._scores:
            log.info("ModelCheckpoint: the best checkpoint by %s (%s) is %s (%g); kept: %s", self.monitor, self.mode,
                     self.best_model_path, self.best_model_score, ", ".join(p.name for p in self._saved))
        elif self._fresh is None:
            log.warning("ModelCheckpoint(monitor=%r) saw no such metric in this fit (validation: a val_dataloader and "
                        "val_check_interval, or the validation at the end of fit), so it kept only the newest %d "
                        "checkpoint(s).", self.monitor, self.keep)

    def save(self, trainer: Trainer) -> Path:
        """Save ``step=<global_step>.ckpt`` in this run's directory (once per step) and return it."""
        path = self.run_dir(trainer) / f"step={trainer.global_step}.ckpt"
        if self._saved_step != trainer.global_step:
            self._saved_step = trainer.global_step
            if self._fresh is not None and self._fresh[0] == trainer.global_step:  # recorded in the checkpoint too
                self._scores[path.name] = self._fresh[1]
            trainer.save_checkpoint(path, async_save=self.async_save, on_saved=self._on_saved)
        return path

    def _on_saved(self, path: Path) -> None:
        """``path`` is complete: point ``last`` at it, then delete those neither among the newest
        ``keep`` nor among the best ``save_top_k`` by ``monitor``."""
        if path not in self._saved:
            self._saved.append(path)
        if self.save_last:
            point_last(path.parent, path)  # before deleting: last never points at a removed checkpoint
        kept = {p.name for p in self._saved[-self.keep:]} | set(self._ranked()[:self.save_top_k])
        for old in [p for p in self._saved if p.name not in kept]:
            remove_checkpoint(old)
            self._saved.remove(old)
            self._scores.pop(old.name, None)

    # -- the best by monitor ------------------------------------------------------------------------
    def _ranked(self) -> list[str]:
        """This run's scored checkpoints, best first (NaN last; a tie: the earlier first)."""
        sign = -1.0 if self.mode == "max" else 1.0
        order = {p.name: i for i, p in enumerate(self._saved)}
        return sorted(self._scores, key=lambda name: (math.isnan(self._scores[name]),
                                                      sign * self._scores[name], order.get(name, len(order))))

    def _ranks_among_best(self, step: int) -> bool:
        """Whether the metric computed at ``step`` would be among the best ``save_top_k`` so far."""
        if self.monitor is None or self._fresh is None or self._fresh[0] != step or math.isnan(self._fresh[1]):
            return False
        ranked = self._ranked()
        if len(ranked) < self.save_top_k:
            return True
        worst = self._scores[ranked[self.save_top_k - 1]]
        return self._fresh[1] > worst if self.mode == "max" else self._fresh[1] < worst

    def _state_key(self) -> str:
        return f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def on_save_checkpoint(self, trainer: Trainer, module: RLModule, checkpoint: dict[str, Any]) -> None:
        if self.monitor is not None:  # the scores of this run's checkpoints, this one's included
            checkpoint.setdefault("callbacks", {})[self._state_key()] = {"scores": dict(self._scores)}

    def on_load_checkpoint(self, trainer: Trainer, module: RLModule, checkpoint: dict[str, Any]) -> None:
        entry = checkpoint.get("callbacks", {}).get(self._state_key()) if self.monitor is not None else None
        self._loaded_scores = {str(k): float(v) for k, v in entry["scores"].items()} if entry else {}


def resolve_ckpt_path(trainer: Trainer, ckpt_path: str | Path) -> Path | None:
    """``fit(ckpt_path=...)``: ``"last"`` is the newest checkpoint in the checkpoint directory (a
    ``ModelCheckpoint``'s, else ``<default_root_dir>/checkpoints``) or beside it, or ``None`` (with a
    warning) on a fresh run, which then starts from scratch; any other value is a path. A ``last.ckpt``
    that points to a deleted checkpoint raises :class:`~rltrainer.checkpoints.CheckpointError`
    (``ckpt_path=None`` starts fresh)."""
    if str(ckpt_path) != "last":
        return Path(ckpt_path)
    dirs = [c.checkpoint_dir(trainer) for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    dirs = dirs or [Path(trainer.default_root_dir) / "checkpoints"]
    for directory in (d for base in dirs for d in run_directories(base)):
        if (target := dangling_last(directory)) is not None:
            older = find_last(directory)  # the newest step=N.ckpt left, if any
            raise CheckpointError(
                f"ckpt_path='last': {directory / 'last.ckpt'} points to {target}, which does not exist (deleted?), "
                f"so what to resume is unknown. "
                + (f"Pass the checkpoint to resume, e.g. the newest left there: ckpt_path={str(older)!r}, "
                   if older is not None else "No checkpoint is left there: ")
                + "or start fresh with ckpt_path=None (command line: leave out --ckpt_path).")
    found = [p for p in map(find_last_run, dirs) if p is not None]
    if not found:
        log.warning("ckpt_path='last': no checkpoint in %s yet; training starts from scratch",
                    ", ".join(str(d) for d in dirs))
        return None
    return found[0]

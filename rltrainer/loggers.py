"""Loggers are Lightning's, resolved by name and imported lazily (``import lightning`` takes
several seconds, so it happens only when a logger is actually used). A logger built by name gets
the run's identity from its :class:`Logger` spec (``Trainer(logger=Logger("wandb", project=...,
run_name=..., run_id=...))``; for W&B a run id that a restarted job reuses, so a preempted run
resumes as the same W&B run); every logger gets the hyperparameters.

A log is whole: a ``validate()`` after ``fit`` reaches every logger and is saved at once
(:func:`save_loggers`), and a run resumed with ``fit(ckpt_path=...)`` writes on in the CSV /
TensorBoard version the checkpointed run wrote (:func:`log_versions`, :func:`continue_logs`), so
one ``metrics.csv`` (and one plot) covers the whole run.

A log is durable: the Trainer saves the loggers after every logged step (``Trainer(log_flush_s=0)``,
:class:`LogFlush`), the CSV one appending its rows (:mod:`rltrainer.csv_logger`) and TensorBoard
flushing its writer, so a killed run loses at most the step in flight. A logger failing to save
while ``fit`` already fails (a full disk) is logged, and the first error is the one raised."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rltrainer.files import read_rows, write_csv_atomically
from rltrainer.values import check_float

#: name -> (module, class).
LOGGER_NAMES = {
    "csv": ("rltrainer.csv_logger", "CSVLogger"),  # Lightning's, never losing or truncating metrics.csv
    "tensorboard": ("rltrainer.tensorboard_logger", "TensorBoardLogger"),  # Lightning's; a full disk is DiskFullError
    "wandb": ("lightning.pytorch.loggers", "WandbLogger"),
    "mlflow": ("lightning.pytorch.loggers", "MLFlowLogger"),
}
log = logging.getLogger(__name__)
#: Loggers that write a numbered version directory under ``save_dir/name``.
VERSIONED = ("CSVLogger", "TensorBoardLogger")
#: where a W&B run id is kept under ``default_root_dir``, so the restarted job logs to the same run.
WANDB_ID_FILE = "wandb_run_id"


@dataclasses.dataclass
class Logger:
    """A logger built by name, with this run's identity; ``Trainer(logger="wandb")`` is
    ``Logger("wandb")``. It is built under the Trainer's ``default_root_dir``.

    Args:
        name: ``"csv"``, ``"tensorboard"``, ``"wandb"`` or ``"mlflow"``.
        project: the W&B project, MLflow experiment, or CSV/TensorBoard folder (default
            ``"lightning_logs"``).
        run_name: the W&B / MLflow run name, the CSV/TensorBoard version.
        run_id: the W&B (or MLflow) run id to log to. ``None`` with ``"wandb"``: the id this job's
            ``default_root_dir`` kept from its first start (``wandb_run_id``), so a job restarted
            after preemption resumes the same W&B run.
    """

    name: str = "csv"
    project: str | None = None
    run_name: str | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.name not in LOGGER_NAMES:
            raise ValueError(f"Unknown logger {self.name!r}. Available logger names: "
                             f"{', '.join(sorted(LOGGER_NAMES))}.")


def build_loggers(logger: Any, default_root_dir: str | Path) -> list[Any]:
    """``True`` -> CSVLogger; ``False``/``None`` -> none; a name (``"csv"``, ``"tensorboard"``,
    ``"wandb"``, ``"mlflow"``); a :class:`Logger` (a name with its run's project, name and id); a
    logger instance; or a list of those."""
    if logger is None or logger is False:
        return []
    if logger is True:
        logger = "csv"
    items = logger if isinstance(logger, (list, tuple)) else [logger]
    return [_build_one(item, default_root_dir) for item in items]


def _build_one(item: Any, root: str | Path) -> Any:
    project = run_name = run_id = None
    if isinstance(item, Logger):
        item, project, run_name, run_id = item.name, item.project, item.run_name, item.run_id
    if not isinstance(item, str):
        if not hasattr(item, "log_metrics"):
            raise TypeError(f"A logger needs a log_metrics(metrics, step) method; got {type(item).__name__}")
        return item
    if item not in LOGGER_NAMES:
        raise ValueError(f"Unknown logger {item!r}. Available logger names: {', '.join(sorted(LOGGER_NAMES))}.")
    import importlib

    module_name, class_name = LOGGER_NAMES[item]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**logger_kwargs(item, root, project, run_name, run_id))


def logger_kwargs(name: str, root: str | Path, project: str | None, run_name: str | None,
                  run_id: str | None) -> dict[str, Any]:
    """The constructor arguments of the Lightning logger ``name`` for this run."""
    if name in ("csv", "tensorboard"):
        return {"save_dir": str(root), "name": project or "lightning_logs", "version": run_name}
    if name == "wandb":
        return {"project": project, "name": run_name, "id": wandb_run_id(root, run_id), "resume": "allow",
                "save_dir": str(root)}
    return {"experiment_name": project or "lightning_logs", "run_name": run_name, "run_id": run_id}  # mlflow


def wandb_run_id(root: str | Path, run_id: str | None) -> str:
    """``run_id``, or the one kept in ``root/wandb_run_id`` from an earlier start of this job (a new
    one is written the first time)."""
    path = Path(root) / WANDB_ID_FILE
    if run_id is None and path.is_file():
        return path.read_text().strip()
    run_id = run_id or uuid.uuid4().hex[:8]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id)
    return run_id


def log_hyperparameters(loggers: list[Any], params: Mapping[str, Any]) -> None:
    """Send ``params`` to every logger that takes hyperparameters."""
    for logger in loggers:
        if hasattr(logger, "log_hyperparams"):
            logger.log_hyperparams(dict(params))


def hyperparameters(obj: Any, prefix: str) -> dict[str, Any]:
    """``obj``'s settings as flat ``prefix/name`` scalars: its public attributes that are numbers,
    strings, booleans or ``None``, and those inside its dicts and dataclasses (``sampling``,
    ``policy_loss_kwargs``...); with its ``flat_settings()`` (a policy-gradient module's parts')."""
    out: dict[str, Any] = {}
    flat = obj.flat_settings() if callable(getattr(obj, "flat_settings", None)) else {}
    for key, value in {**vars(obj), **flat}.items():
        if key.startswith("_") or key.endswith("metrics"):  # private state, the metrics of a run
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, Mapping):
            out.update({f"{prefix}/{key}/{k}": v for k, v in value.items() if _scalar(v)})
        elif _scalar(value):
            out[f"{prefix}/{key}"] = value
    return out


def hyperparameters_of(**objects: Any) -> dict[str, Any]:
    """:func:`hyperparameters` of each object, prefixed with its keyword (``trainer=trainer``)."""
    return {k: v for prefix, obj in objects.items() for k, v in hyperparameters(obj, prefix).items()}


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def save_loggers(loggers: list[Any], failing: BaseException | None = None) -> None:
    """Write what the loggers hold (Lightning's CSV logger keeps rows in memory until ``save``). Every
    logger is saved even if one fails; the first error is raised then, unless ``failing`` (the error
    that is ending ``fit``) is given: then it is logged, so that it does not hide ``failing``."""
    first: BaseException | None = None
    for logger in loggers:
        try:
            if hasattr(logger, "save"):
                logger.save()
        except Exception as exc:
            if failing is None and first is None:
                first = exc
            else:
                log.error("%s could not save its log (%s: %s)%s", type(logger).__name__, type(exc).__name__, exc,
                          f" while {type(failing).__name__} ends the run" if failing is not None else "")
    if first is not None:
        raise first


class LogFlush:
    """When the loggers write what they hold: ``every_s=0`` after every logged step, before the next
    step starts; ``every_s > 0`` at the first logged step ``every_s`` seconds or more after the last
    write (and at the end of ``fit``); ``math.inf`` only at the end of ``fit`` (Lightning's CSV logger
    alone would write every 100 steps)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = check_float("log_flush_s", every_s, at_least=0, finite=False, meaning=(
            "seconds; 0: after every logged step; math.inf: only at the end of fit"))
        self.last = time.monotonic()

    def log(self, loggers: list[Any], metrics: Mapping[str, float], step: int) -> None:
        """Send ``metrics`` of ``step`` to every logger, then save them if it is time to."""
        for logger in loggers:
            logger.log_metrics(metrics, step=step)
        self(loggers)

    def __call__(self, loggers: list[Any]) -> None:
        if math.isinf(self.every_s) or time.monotonic() - self.last < self.every_s:
            return
        save_loggers(loggers)
        self.last = time.monotonic()


def _versioned_kind(logger: Any) -> str | None:
    return next((cls.__name__ for cls in type(logger).__mro__ if cls.__name__ in VERSIONED), None)


def log_versions(loggers: list[Any]) -> list[dict[str, Any] | None]:
    """For a checkpoint, per logger in order: the CSV / TensorBoard ones' ``{"kind", "version"}``, ``None``
    for the others (W&B and MLflow resume by run id)."""
    return [{"kind": kind, "version": logger.version} if (kind := _versioned_kind(logger)) else None
            for logger in loggers]


def continue_logs(loggers: list[Any], checkpoint: Mapping[str, Any]) -> None:
    """Before a resumed run logs anything: point each CSV / TensorBoard logger at the version the
    checkpoint recorded (``checkpoint["loggers"]``, :func:`log_versions`), unless it was given another
    version or has logged already, and keep that ``metrics.csv``'s rows (TensorBoard's events) up to
    the checkpoint's ``global_step`` (those past it came from the interrupted run after its
    checkpoint; the resumed run writes them again)."""
    for logger, saved in zip(loggers, checkpoint.get("loggers") or []):
        kind = _versioned_kind(logger)
        if saved is None or kind != saved.get("kind"):
            continue
        if getattr(logger, "_experiment", None) is not None or getattr(logger, "_version", None) not in (
                None, saved["version"]):
            log.info("%s continues in version %s, not the checkpoint's %s (it has logged already or was given "
                     "another version); `python -m rltrainer.plot` shows one version at a time", kind,
                     logger.version, saved["version"])
            continue
        logger._version = saved["version"]
        if kind == "CSVLogger":
            _continue_csv(logger, checkpoint["global_step"])
        elif isinstance(getattr(logger, "_kwargs", None), dict):  # TensorBoard: drop events past the checkpoint
            logger._kwargs.setdefault("purge_step", checkpoint["global_step"] + 1)


def _continue_csv(logger: Any, step: int) -> None:
    """Open the CSV logger's existing version, keeping its rows up to ``step`` (and none a killed write
    left torn), rewritten atomically."""

    path = Path(logger.log_dir) / "metrics.csv"
    keys, rows = read_rows(path) if path.is_file() else ([], [])
    rows = [row for row in rows if not row.get("step") or float(row["step"]) <= step]
    with warnings.catch_warnings():  # "... exists and is not empty. Previous log files ... will be deleted"
        warnings.simplefilter("ignore")
        experiment = logger.experiment  # Lightning's own CSVLogger removes metrics.csv here (ours does not)
    experiment.fresh = False  # rltrainer's CSVLogger: write on after these rows
    if keys:
        write_csv_atomically(path, keys, rows)
        experiment.metrics_keys = keys  # later rows append under this header (a new key rewrites it)

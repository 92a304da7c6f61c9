"""The CSV logger that ``logger=True`` / ``"csv"`` builds: Lightning's ``CSVLogger`` with a
``metrics.csv`` that is never lost or truncated.

Lightning's writer keeps rows in memory (100 steps by default), deletes an existing ``metrics.csv``
when it opens its directory, and rewrites the file in place (truncate, then write) when a new column
appears: a kill loses the rows in memory, and a full disk during a rewrite leaves the file empty.
Here (:class:`DurableWriter`):

- rows are appended (one ``write`` of the encoded rows; on an error the file is cut back to its
  previous length, so no half row stays), which costs about the same per step whether the log holds 10 or
  10,000 rows (``Trainer(log_flush_s=0)`` saves after every logged step: ``tests/test_faults_durable.py``
  measures it);
- a new column rewrites the whole file into a temporary file renamed over the old one (atomic: the
  old file stays whole until the new one is);
- a full disk raises :class:`~rltrainer.checkpoints.DiskFullError` naming ``metrics.csv``, and the
  rows not written stay in memory for the next save.

The file is written to the operating system at every save (a killed process loses nothing saved);
it is not ``fsync``-ed at every step (a machine that loses power may lose the last seconds).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from rltrainer.files import append_rows, read_rows, reporting_disk_full, sibling, write_csv_atomically


class DurableWriter(ExperimentWriter):
    """Lightning's ``ExperimentWriter`` that appends rows and rewrites ``metrics.csv`` atomically.

    ``fresh``: the first save replaces a ``metrics.csv`` already in the directory (Lightning's
    behaviour, without deleting it first); :func:`rltrainer.loggers.continue_logs` clears it to
    write on after the rows it kept."""

    def __init__(self, log_dir: str) -> None:
        self.fresh = True
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        """Lightning deletes ``metrics.csv`` here; it is replaced at the first save instead."""

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        path = Path(self.log_dir) / self.NAME_HPARAMS_FILE
        with reporting_disk_full(path, "the hyperparameters"):
            tmp = sibling(path)
            try:
                save_hparams_to_yaml(str(tmp), self.hparams)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)

    def save(self) -> None:
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        new_keys = sorted(set().union(*self.metrics) - set(self.metrics_keys))
        keys = sorted({*self.metrics_keys, *new_keys})
        if self.fresh or new_keys or not path.is_file():
            old = [] if self.fresh or not path.is_file() else read_rows(path)[1]
            write_csv_atomically(path, keys, [*old, *self.metrics])
        else:
            append_rows(path, keys, self.metrics)
        self.metrics_keys, self.metrics, self.fresh = keys, [], False


class CSVLogger(LightningCSVLogger):
    """Lightning's ``CSVLogger`` writing through :class:`DurableWriter` (same arguments)."""

    @property
    def experiment(self) -> DurableWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = DurableWriter(log_dir=self.log_dir)
        return self._experiment

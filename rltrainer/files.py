"""Files that are never half-written: rows appended in one write (cut back on an error) and whole
files replaced under a temporary name; a full disk is a :class:`~rltrainer.checkpoints.DiskFullError`
naming the file. Used by the CSV logger (:mod:`rltrainer.csv_logger`), the resumed log
(:func:`rltrainer.loggers.continue_logs`) and ``generations.jsonl``; imports nothing heavy."""

from __future__ import annotations

import csv
import io
import os
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rltrainer.checkpoints import reporting_disk_full


def read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and rows of a CSV file, without a torn last row (one a killed write left short)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = [row for row in reader if None not in row.values() and None not in row]
        return list(reader.fieldnames or []), rows


def _encode(keys: Sequence[str], rows: Iterable[dict[str, Any]], header: bool) -> bytes:
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=list(keys))
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue().encode()


def append_rows(path: Path, keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    """Append ``rows`` (under the file's header ``keys``) in one write (:func:`append_bytes`)."""
    append_bytes(path, _encode(keys, rows, header=False), f"{len(rows)} metrics row(s)")


def append_bytes(path: Path, data: bytes, what: str) -> None:
    """Append ``data`` (``what`` it holds) to ``path`` in one write; on an error, cut the file back to
    its length before, so it never ends in half a row; a full disk is a ``DiskFullError``."""
    with reporting_disk_full(path, what, len(data)), open(path, "ab", buffering=0) as f:
        start = f.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
        except BaseException:
            f.truncate(start)
            raise


def write_csv_atomically(path: Path, keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    """Write ``path`` whole (header ``keys``, then ``rows``) under a temporary name and rename it over
    the old file: a reader or a crash sees the old file or the new one, never a part."""
    data = _encode(keys, rows, header=True)
    tmp = sibling(path)
    try:
        with reporting_disk_full(path, f"the metrics log ({len(rows)} rows)", len(data)), open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")

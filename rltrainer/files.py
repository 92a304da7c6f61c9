"""Files that are never half-written: rows appended in one write (cut back on an error) and whole
files replaced under a temporary name; a full disk is a :class:`DiskFullError` naming the file
(:func:`reporting_disk_full` around any write: checkpoints, shards, logs). Used by the checkpoints
(:mod:`rltrainer.checkpoints`, which re-exports :class:`DiskFullError`), the CSV logger
(:mod:`rltrainer.csv_logger`), the resumed log (:func:`rltrainer.loggers.continue_logs`) and
``generations.jsonl``; imports nothing heavy."""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any


# -- a full disk, named ------------------------------------------------------------------------------
class DiskFullError(OSError):
    """No space left on the device while writing a file (``errno`` is ``ENOSPC``, ``filename`` the
    file); the message names the file, the bytes it needed when known and those that were free."""

    def __str__(self) -> str:
        return str(self.strerror)


def disk_full_error(path: Path, what: str, needed: int | None, free_before: int | None = None,
                    together: tuple[str, int] | None = None) -> DiskFullError:
    """A :class:`DiskFullError` for ``path`` (``what`` it held) with the figures that explain it: the
    bytes it ``needed`` (``None``: unknown) and, with ``together`` (``(who, bytes)``), what the writes
    beside it into the same file system needed at the same time; what was written there before the
    space ran out (a directory's files); the free space when it started, of the file system's size,
    where it is mounted, and the blocks reserved for root that an unprivileged writer cannot use."""
    space = _space(path)
    if free_before is None and space is not None:
        free_before = space[1]
    need = f"about {needed:,} bytes" if needed is not None else "more space"
    if together is not None:
        need += f", and {together[0]} about {together[1]:,} bytes written into the same file system at once"
    written = _written(path)
    if written:
        need += f"; {written:,} bytes were written there before the space ran out"
    if free_before is None:
        free = "the free space is unknown"
    elif space is None:
        free = f"{free_before:,} bytes were free on its file system"
    else:
        mount, size, _, reserved = space[0], space[2], space[1], space[3]
        free = (f"{free_before:,} bytes were free when it started, of the {size:,} of the file system mounted at "
                f"{mount}" + (f" ({reserved:,} more are reserved for root)" if reserved else ""))
    return DiskFullError(errno.ENOSPC, f"The disk is full (No space left on device) writing {path} ({what}): it "
                                       f"needed {need}; {free}. Nothing written before was changed. Free space "
                                       f"there, or write elsewhere (default_root_dir, ModelCheckpoint(dirpath=...))",
                         str(path))


def _space(path: Path) -> tuple[Path, int, int, int] | None:
    """``(mount point, bytes free to this user, size, bytes reserved for root)`` of ``path``'s file
    system, or ``None`` if it cannot be read."""
    try:
        existing = _existing(path).resolve()
        stats = os.statvfs(existing)
    except OSError:
        return None
    mount = existing
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    block = stats.f_frsize
    return mount, stats.f_bavail * block, stats.f_blocks * block, (stats.f_bfree - stats.f_bavail) * block


def _written(path: Path) -> int:
    """The bytes of ``path`` (a directory: of its files), 0 if there are none or they cannot be read."""
    path = Path(path)
    with contextlib.suppress(OSError):
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return 0


def is_disk_full(exc: BaseException, path: Path | None = None) -> bool:
    """Whether ``exc``, or an error it was raised from or wraps (DCP's ``CheckpointException`` keeps
    each rank's), is a full disk; with ``path``, torch's zip writer's ``unexpected pos`` (a short
    write, its only report of ENOSPC) counts when less than 1 MiB is free there."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    short_write = False
    while todo:
        err = todo.pop()
        if isinstance(err, tuple):  # DCP: (exception, stack)
            todo += [e for e in err if isinstance(e, BaseException)]
            continue
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        if getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err):
            return True
        short_write |= "unexpected pos" in str(err)
        failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        todo += [err.__cause__, err.__context__, *(failures.values() if isinstance(failures, Mapping) else [])]
    if short_write and path is not None:
        with contextlib.suppress(OSError):
            return shutil.disk_usage(_existing(path)).free < 1 << 20
    return False


@contextlib.contextmanager
def reporting_disk_full(path: Path, what: str, needed: int | None = None,
                        together: tuple[str, int] | None = None) -> Iterator[None]:
    """Run the block that writes ``path``; a full disk in it raises :class:`DiskFullError` (from the
    original error, with the figures of :func:`disk_full_error`), any other error passes unchanged."""
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(_existing(path)).free
    try:
        yield
    except DiskFullError:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if not is_disk_full(exc, path):
            raise
        raise disk_full_error(path, what, needed, free, together) from exc


@contextlib.contextmanager
def raising_ranks_disk_full() -> Iterator[None]:
    """Around the controller's calls into training ranks: a rank's :class:`DiskFullError` (the cause
    of the ``WorkerError`` that reports it) is raised here as a :class:`DiskFullError` too, from that
    ``WorkerError``, so a full disk is the same error on every strategy."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        cause = exc.__cause__
        if not isinstance(cause, DiskFullError):
            raise
        raise DiskFullError(cause.errno, f"Rank {getattr(exc, 'rank', '?')}: {cause.strerror}. The ranks were "
                                         f"stopped (the WorkerError this is raised from has each rank's "
                                         f"report)", cause.filename) from exc


def check_writable(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and write (then remove) a file in it, so a directory that cannot
    be written (read-only, not permitted, under a file) is refused now, not at its first write; the
    error (of the same ``OSError`` kind) names ``what`` it is for and the reason."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".rltrainer-write-test-{uuid.uuid4().hex[:8]}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise type(exc)(exc.errno, f"{what} cannot write to {directory}: {exc.strerror or exc} (at {exc.filename}). "
                                   "Nothing was trained yet. Give it a directory you can write to.") from exc


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (what ``shutil.disk_usage`` can look at)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path



# -- rows and whole files ---------------------------------------------------------------------------
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

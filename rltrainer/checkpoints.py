"""A checkpoint on disk: a directory that becomes visible only once it is complete.

``Trainer.save_checkpoint(path)`` writes ``path`` (e.g. ``checkpoints/step=4.ckpt``) as a directory::

    trainer.pt    the controller's small state: format, counters, RNG, data position, callbacks,
                  and the strategy's own (its ranks' RNG, its layout)
    training/     models, optimizers and schedulers, as the strategy writes them: one file
                  (``single``), every rank's shards (``fsdp2``: ``torch.distributed.checkpoint``),
                  or whole tensors under Hugging Face names, written by every pipeline stage
                  (``megatron``: any tensor / pipeline / data-parallel layout loads them)

It is written under a temporary name next to ``path`` (:func:`atomic_directory`) and renamed onto it
when complete; ``last.ckpt`` is a symlink replaced in one rename (:func:`point_last`). A crash
mid-save leaves the previous checkpoint and ``last`` as they were, plus a ``.<name>.tmp-*``
directory the next save of that name removes.

Everything is read with ``torch.load(weights_only=True)`` (:func:`safe_load`; numpy arrays, which
the RNG state and dataset rows hold, are allowed): a checkpoint cannot run code when opened. An
object a callback adds to the checkpoint must be a plain type or registered with
``torch.serialization.add_safe_globals``. Every failure to read raises :class:`CheckpointError`,
naming the path, what was expected and what was found.

``checksums.json`` holds the sha256 of every other file of the checkpoint, written before the rename
(:func:`write_manifest`; each rank hashes the files it wrote, the controller its own); loading checks
each file against it before anything is deserialized (:func:`verify_files`), so a flipped or zeroed
byte raises :class:`CheckpointError` naming the file. A checkpoint without one (older rltrainer)
loads with a warning.

Deleting renames first (:func:`remove_checkpoint`: ``.<name>.deleting-*``), so a checkpoint killed
mid-delete is never taken for a checkpoint; :func:`clean_leftovers` finishes such deletions.

Every file of a checkpoint is written through :func:`save_file` (or inside :func:`reporting_disk_full`,
for ``torch.distributed.checkpoint`` and safetensors shards): a full disk raises :class:`DiskFullError`
naming the file, the bytes it needed and those that were free, instead of torch's ``unexpected pos``.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import logging
import os
import pickle
import random
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rltrainer.files import DiskFullError as DiskFullError  # where users catch it (the docs say rltrainer.checkpoints)
from rltrainer.files import reporting_disk_full

FORMAT = "rltrainer-checkpoint"
VERSION = 2
TRAINER_FILE = "trainer.pt"
TRAINING_DIR = "training"
LAST = "last.ckpt"
MANIFEST = "checksums.json"
CHECKSUMS_FORMAT = "rltrainer-checksums"

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that is missing a part, truncated, not an rltrainer checkpoint, or of another model."""


def tensor_bytes(obj: Any, whole: bool = False) -> int:
    """The bytes of the tensors in ``obj`` (nested dicts, lists and tuples): about what saving it takes;
    a DTensor counts this rank's shard, or with ``whole`` all ranks' (what they save together)."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") and not whole else obj  # a DTensor: this rank's shard
        return local.numel() * local.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v, whole) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, whole) for v in obj)
    return 0


def save_file(obj: Any, path: Path, what: str) -> None:
    """``torch.save(obj, path)`` through an open file, so that a full disk is :class:`DiskFullError`
    naming ``path`` (torch's own writer reports it as ``unexpected pos``, with no path)."""
    with reporting_disk_full(Path(path), what, tensor_bytes(obj)), open(path, "wb") as f:
        torch.save(obj, f)


# -- writing ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``path`` (:func:`temporary_directory`); when the
    block ends without an error, rename it onto ``path`` (:func:`commit_directory`). On an error it is
    removed; on a crash it stays, under a name no reader takes for a checkpoint, until the next save
    of ``path``."""
    tmp = temporary_directory(path)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_directory(tmp, path)


def temporary_directory(path: Path) -> Path:
    """A new empty ``.<name>.tmp-<id>`` next to ``path``, after removing those a crash left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def commit_directory(tmp: Path, path: Path) -> None:
    """Flush ``tmp`` to disk and rename it onto ``path`` (a checkpoint already there is replaced)."""
    _fsync_tree(tmp)
    old = None
    if path.is_dir() and not path.is_symlink():
        old = _deleting_name(path)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def point_last(directory: Path, target: Path) -> Path:
    """Make ``directory/last.ckpt`` a relative symlink to ``target``, replaced in one rename."""
    last = directory / LAST
    tmp = directory / f".{LAST}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.symlink_to(os.path.relpath(target, directory))
    os.replace(tmp, last)
    _fsync_dir(directory)
    return last


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint directory (or a file of the older single-file format): renamed to
    ``.<name>.deleting-<id>`` first, so that a deletion killed half-way leaves no ``step=N.ckpt``
    behind (:func:`clean_leftovers` finishes it)."""
    if path.is_dir() and not path.is_symlink():
        doomed = _deleting_name(path)
        os.rename(path, doomed)
        _fsync_dir(path.parent)
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _deleting_name(path: Path) -> Path:
    return path.parent / f".{path.name}.deleting-{uuid.uuid4().hex[:8]}"


def clean_leftovers(directory: Path, temporary: bool = False) -> list[Path]:
    """Finish the deletions a crash interrupted in ``directory`` (``.*.deleting-*``, and ``.*.old-*``
    of older rltrainer); with ``temporary``, also remove the partial saves a crash left (``.*.tmp-*``:
    only where no other process is saving). Returns what was removed."""
    patterns = [".*.deleting-*", ".*.old-*", *([".*.tmp-*"] if temporary else [])]
    found = [p for pattern in patterns for p in directory.glob(pattern)] if directory.is_dir() else []
    for leftover in found:
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
    return found


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` to disk before the rename makes it visible."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system can sync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- finding -------------------------------------------------------------------------------------------
def find_last(directory: Path) -> Path | None:
    """``directory/last.ckpt`` if it exists, else the complete ``step=N.ckpt`` with the largest N
    (``save_last=False``), else ``None``."""
    last = directory / LAST
    if last.exists():
        return last
    steps = [(n, p) for n, p in step_checkpoints(directory) if is_complete(p)]
    return max(steps)[1] if steps else None


def step_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """The ``(N, path)`` of every ``step=N.ckpt`` directory in ``directory``, complete or not, by N."""
    found = directory.glob("step=*.ckpt") if directory.is_dir() else []
    return sorted((int(p.name[5:-5]), p) for p in found if p.name[5:-5].isdigit() and p.is_dir())


def is_complete(path: Path) -> bool:
    """Whether checkpoint directory ``path`` has its ``trainer.pt`` and every file its
    ``checksums.json`` lists (by their presence only: a deletion killed half-way fails this)."""
    if not (path / TRAINER_FILE).is_file():
        return False
    try:
        files = read_manifest(path)
    except CheckpointError:
        return False
    return files is None or all((path / name).is_file() for name in files)


def dangling_last(directory: Path) -> str | None:
    """What ``directory/last.ckpt`` points to if that does not exist (a deleted checkpoint), else ``None``."""
    last = directory / LAST
    return os.readlink(last) if last.is_symlink() and not last.exists() else None


def run_directories(directory: Path) -> list[Path]:
    """``directory`` and the directories of the runs started beside it (``<name>-2``, ``<name>-3``...,
    see :func:`fresh_run_directory`) that exist."""
    siblings = directory.parent.glob(f"{glob.escape(directory.name)}-*") if directory.parent.is_dir() else []
    numbered = sorted((int(p.name.rsplit("-", 1)[1]), p) for p in siblings if p.name.rsplit("-", 1)[1].isdigit())
    return [p for p in (directory, *(p for _, p in numbered)) if p.is_dir()]


def find_last_run(directory: Path) -> Path | None:
    """The newest checkpoint (by its ``trainer.pt``'s time) of the runs in ``directory`` and beside it
    (:func:`run_directories`): what ``ckpt_path="last"`` resumes; ``None`` if there is none."""
    found = [p for p in map(find_last, run_directories(directory)) if p is not None]
    return max(found, key=lambda p: (p / TRAINER_FILE).stat().st_mtime, default=None)


def fresh_run_directory(directory: Path) -> Path:
    """Where a run that starts from scratch writes its checkpoints: ``directory`` if it holds none,
    else the first of ``<name>-2``, ``<name>-3``... that holds none, so that another run's checkpoints
    are never replaced."""
    candidate, n = directory, 1
    while find_last(candidate) is not None:
        n += 1
        candidate = directory.with_name(f"{directory.name}-{n}")
    return candidate


# -- checksums -----------------------------------------------------------------------------------------
def file_digest(path: Path) -> str:
    """The sha256 of the file ``path``, as hex (read in 4 MiB chunks; hashlib releases the GIL)."""
    digest, chunk = hashlib.sha256(), bytearray(4 << 20)
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            digest.update(view[:n])
    return digest.hexdigest()


def digest_files(root: Path, names: Iterable[str]) -> dict[str, str]:
    """``{name: sha256}`` of the files ``root / name``."""
    return {name: file_digest(root / name) for name in names}


def files_under(root: Path) -> list[str]:
    """Every file under ``root`` but its ``checksums.json``, by path relative to it (``/``-separated)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path, digests: Mapping[str, str]) -> None:
    """Write ``root/checksums.json``: the sha256 of every file under ``root``, taken from ``digests``
    (hashed where the files were written: each rank its own) and computed here for the rest."""
    files = files_under(root)
    unknown = sorted(set(digests) - set(files))
    assert not unknown, f"digests of files that are not in {root}: {unknown[:4]}"
    missing = [name for name in files if name not in digests]
    entries = {**digests, **digest_files(root, missing)}
    manifest = {"format": CHECKSUMS_FORMAT, "algorithm": "sha256", "files": {n: entries[n] for n in files}}
    with open(root / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)


def read_manifest(path: Path) -> dict[str, str] | None:
    """``{file: sha256}`` from checkpoint ``path``'s ``checksums.json``, or ``None`` if it has none."""
    file = path / MANIFEST
    if not file.exists():
        return None
    try:
        manifest = json.loads(file.read_text())
        if manifest["format"] != CHECKSUMS_FORMAT or manifest["algorithm"] != "sha256":
            raise ValueError(f"format {manifest['format']!r}, algorithm {manifest['algorithm']!r}")
        return {str(k): str(v) for k, v in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} should list the sha256 of every file of the checkpoint "
                              f"({CHECKSUMS_FORMAT}), but it cannot be read: it is damaged ({type(exc).__name__}: "
                              f"{_first_line(exc)}). Resume from another checkpoint (e.g. ckpt_path='last').") from exc


def check_files(root: Path, expected: Mapping[str, str]) -> list[str]:
    """One line per file under ``root`` that is missing or whose sha256 is not the one ``expected``
    (``{name: sha256}``) records; empty when all match."""
    problems = []
    for name, digest in sorted(expected.items()):
        file = root / name
        if not file.is_file():
            problems.append(f"{file} is missing (checksums.json lists it)")
        elif (actual := file_digest(file)) != digest:
            problems.append(f"{file} is corrupted: its sha256 is {actual}, but was {digest} when it was saved")
    return problems


def raise_if_damaged(problems: list[str]) -> None:
    """Raise :class:`CheckpointError` for the :func:`check_files` lines ``problems``, if any."""
    if problems:
        more = f" ({len(problems) - 1} more file(s) damaged: {'; '.join(problems[1:3])})" if problems[1:] else ""
        raise CheckpointError(f"{problems[0]}{more}. Nothing was loaded from it. Resume from another checkpoint "
                              f"(e.g. an earlier step=N.ckpt), or start fresh (ckpt_path=None).")


def verify_files(root: Path, expected: Mapping[str, str]) -> None:
    """Raise :class:`CheckpointError` naming the first file under ``root`` missing or changed since
    ``expected`` (``{name: sha256}``) recorded it."""
    raise_if_damaged(check_files(root, expected))


def training_digests(path: Path) -> dict[str, str] | None:
    """``{name: sha256}`` of the files of checkpoint ``path``'s ``training/`` directory (names relative
    to it), or ``None`` (with a warning) for a checkpoint saved without checksums."""
    files = read_manifest(path)
    if files is None:
        log.warning("%s has no %s (saved by an older rltrainer): its files are loaded without verifying "
                    "their checksums.", path, MANIFEST)
        return None
    prefix = f"{TRAINING_DIR}/"
    return {name[len(prefix):]: digest for name, digest in files.items() if name.startswith(prefix)}


def load_training(strategy: Any, path: Path, state: dict[str, Any]) -> None:
    """Check the files of checkpoint ``path``'s ``training/`` against its checksums (the strategy's
    ranks each check a share, where they are), then have the strategy load them."""
    directory = path.resolve() / TRAINING_DIR
    expected = training_digests(path)
    if expected is not None:
        raise_if_damaged(strategy.verify_checkpoint(directory, expected))
    strategy.load_checkpoint(directory, state)


def seal(tmp: Path, strategy: Any) -> None:
    """The checkpoint under its temporary name ``tmp`` is about to be committed: wait for the
    strategy's writes, then write its ``checksums.json`` (the strategy's digests of the files its
    ranks wrote, and the controller's of its own)."""
    strategy.wait_checkpoint()
    digests = strategy.checkpoint_digests(tmp / TRAINING_DIR)
    write_manifest(tmp, {f"{TRAINING_DIR}/{name}": digest for name, digest in digests.items()})


# -- reading -------------------------------------------------------------------------------------------
def _numpy_globals() -> list[Any]:
    """What ``weights_only`` needs for numpy arrays (the numpy RNG state, dataset rows)."""
    core = getattr(np, "_core", None) or np.core
    dtypes = {type(np.dtype(c)) for c in "?bhilqBHILQefdgFDGOUS"}
    return [np.ndarray, np.dtype, core.multiarray._reconstruct, *sorted(dtypes, key=str)]


def safe_load(source: Path | io.BytesIO, what: str, path: Path | None = None) -> Any:
    """``torch.load(source, weights_only=True)`` with numpy arrays allowed; any failure raises
    :class:`CheckpointError` naming ``path`` and ``what`` it should hold."""
    path = path if path is not None else source
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" in str(exc):  # else a damaged file: its pickle has bytes no pickle writes
            raise CheckpointError(
                f"{path} ({what}) holds an object that loading with weights_only=True refuses, so it is not opened "
                f"(it could run code). If you trust it and the object is yours (e.g. a callback's state), register "
                f"its class with torch.serialization.add_safe_globals([...]). Details: {_first_line(exc)}") from exc
        raise _unreadable(path, what, exc) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise _unreadable(path, what, exc) from exc


def _unreadable(path: Any, what: str, exc: BaseException) -> CheckpointError:
    return CheckpointError(f"{path} should hold {what}, but it cannot be read: it is truncated (a save that did not "
                           f"finish), damaged, or not a file torch.save wrote "
                           f"({type(exc).__name__}: {_first_line(exc)}). Resume from another checkpoint (e.g. "
                           f"ckpt_path='last').")


def _first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)[:300]


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The controller's state of checkpoint ``path``, after checking it is one."""
    if path.is_symlink() and not path.exists():
        raise CheckpointError(f"{path} points to {os.readlink(path)}, which does not exist (deleted?). Pass an "
                              f"existing checkpoint, or start fresh (ckpt_path=None).")
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file; an rltrainer checkpoint is a directory with {TRAINER_FILE} and {TRAINING_DIR}/, as "
            f"Trainer.save_checkpoint and ModelCheckpoint write it (a single-file .ckpt comes from an older "
            f"rltrainer or another library). Pass a checkpoint directory, or 'last'.")
    file = path / TRAINER_FILE
    if not file.is_file():
        found = sorted(p.name for p in path.iterdir())[:8]
        raise CheckpointError(f"{path} is not a complete rltrainer checkpoint: expected {TRAINER_FILE} and "
                              f"{TRAINING_DIR}/ in it, found {found or 'nothing'}.")
    files = read_manifest(path)
    if files is not None:
        if TRAINER_FILE not in files:
            raise CheckpointError(f"{path / MANIFEST} does not list {TRAINER_FILE}: it is not this checkpoint's. "
                                  f"Resume from another checkpoint, or start fresh (ckpt_path=None).")
        verify_files(path, {TRAINER_FILE: files[TRAINER_FILE]})
    state = safe_load(file, "an rltrainer checkpoint's trainer state")
    if files is None and isinstance(state, Mapping) and state.get("checksums"):
        raise CheckpointError(f"{path} has no {MANIFEST}, but was saved with one: its files cannot be verified. "
                              f"Resume from another checkpoint, or start fresh (ckpt_path=None).")
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        got = sorted(state)[:8] if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointError(f"{file} is not an rltrainer checkpoint: expected a dict with format={FORMAT!r}, "
                              f"found {got}.")
    if state.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {state.get('version')}; this rltrainer reads "
                              f"version {VERSION}.")
    return dict(state)


def check_state_matches(where: str, expected: Mapping[str, tuple[int, ...]],
                        found: Mapping[str, tuple[int, ...]], show: int = 5) -> None:
    """Raise :class:`CheckpointError` if the names or shapes of ``found`` (the checkpoint's) differ
    from ``expected`` (the model's): the first ``show`` differences and how many in all."""
    diffs = [f"{n}: model {tuple(expected[n])}, checkpoint {tuple(found[n])}"
             for n in expected if n in found and tuple(expected[n]) != tuple(found[n])]
    diffs += [f"{n}: model {tuple(expected[n])}, not in the checkpoint" for n in expected if n not in found]
    diffs += [f"{n}: not in the model, checkpoint {tuple(found[n])}" for n in found if n not in expected]
    if diffs:
        raise CheckpointError(
            f"{where} does not fit the model: {len(diffs)} tensor(s) differ in name or shape, e.g. "
            f"{'; '.join(diffs[:show])}. Resume with the model configuration the checkpoint was trained with.")


def shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors of a state dict by name and (global) shape."""
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def controller_rng_state() -> dict[str, Any]:
    """This process's torch, numpy, Python and CUDA RNG states, as a checkpoint keeps them."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_controller_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def seed_controller(seed: int) -> None:
    """Seed this process's Python, numpy and torch RNGs (the start of ``fit`` and ``validate``)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

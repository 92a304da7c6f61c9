"""FSDP2's checkpoints: a rank's part of a sharded checkpoint, with ``torch.distributed.checkpoint`` (DCP).

Every rank calls :func:`save_sharded` with its own (sharded, DTensor) state dict and writes only its
shards into one shared directory; DCP's metadata records each tensor's global shape and where its
pieces are, so :func:`load_sharded` fills any layout of the same tensors, on any number of ranks
(resharding). Nothing is gathered on one process.

Reading never unpickles arbitrary objects: DCP reads its ``.metadata`` with ``pickle.load`` and its
non-tensor entries with ``torch.load(weights_only=False)``; here the metadata goes through an
unpickler that allows DCP's own metadata classes only, and the entries through
:func:`~rltrainer.checkpoints.safe_load`.

DCP takes about a second to import, so it is imported on first use (:func:`_safe_dcp`), not with
this module.
"""

from __future__ import annotations

import functools
import io
import pickle
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rltrainer.checkpoints import CheckpointError, check_state_matches, safe_load, tensor_bytes
from rltrainer.files import reporting_disk_full
from rltrainer.process_groups import host_group

_METADATA_GLOBALS = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"), ("torch", "Size"),
                     ("torch.serialization", "_get_layout"), ("torch._utils", "_get_layout"),
                     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes, torch sizes and dtypes, and paths."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = (module.startswith("torch.distributed.checkpoint.") or (module, name) in _METADATA_GLOBALS
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not in a torch.distributed.checkpoint metadata file")
        return super().find_class(module, name)


@functools.cache
def _safe_dcp() -> tuple[type, type]:
    """DCP's ``FileSystemReader`` and ``DefaultLoadPlanner``, made safe (built on first use)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, Metadata
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeReader(FileSystemReader):
        """``FileSystemReader`` whose metadata is read by :class:`_MetadataUnpickler`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            try:
                with self.fs.create_stream(path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except FileNotFoundError as exc:
                name = path.name if hasattr(path, "name") else path
                raise CheckpointError(f"{self.path} should hold a sharded checkpoint (torch.distributed.checkpoint), "
                                      f"but it has no {name}: the save did not finish or this is not one.") from exc
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
                raise CheckpointError(f"{path} should be a torch.distributed.checkpoint metadata file, but it cannot "
                                      f"be read: it is truncated or foreign ({type(exc).__name__}: {exc}).") from exc
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """``DefaultLoadPlanner`` that loads non-tensor entries with ``weights_only=True``."""

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            fqn = read_item.dest_index.fqn
            storage = getattr(self.metadata, "storage_meta", None)
            where = Path(str(getattr(storage, "checkpoint_id", None) or "the sharded checkpoint"))
            obj = safe_load(value, f"the checkpoint entry {fqn}", path=where)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeReader, SafeLoadPlanner


def save_sharded(state: dict[str, Any], directory: str | Path, async_save: bool = False) -> Future | None:
    """This rank's shards of ``state`` into ``directory`` (a collective: every rank calls it). With
    ``async_save``: copy them to host memory, write them in a background thread whose collectives
    use a gloo group of their own (training's go on meanwhile), and return its future."""
    from torch.distributed.checkpoint import save as dcp_save

    if not async_save:
        import torch.distributed as dist

        ranks = dist.get_world_size() if dist.is_initialized() else 1
        together = (f"the {ranks} ranks' shards together", tensor_bytes(state, whole=True)) if ranks > 1 else None
        with reporting_disk_full(Path(directory), "this rank's shards (torch.distributed.checkpoint)",
                                 tensor_bytes(state), together):
            dcp_save(state, checkpoint_id=str(directory))
        return None
    from torch.distributed.checkpoint import async_save as dcp_async_save

    return dcp_async_save(state, checkpoint_id=str(directory), process_group=host_group(own="checkpoint writes"))


def saved_shapes(directory: str | Path, prefix: str) -> dict[str, tuple[int, ...]]:
    """The global shapes of the saved tensors whose flattened name starts with ``prefix``
    (``prefix`` stripped)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader, _ = _safe_dcp()
    metadata = reader(str(directory)).read_metadata()
    return {k[len(prefix):]: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}


def load_sharded(state: dict[str, Any], directory: str | Path, models: dict[str, dict[str, Any]]) -> None:
    """Fill ``state`` (this rank's layout; a collective) from ``directory``, after checking that
    ``models`` (name -> this rank's model state dict, whose tensors give their global shapes) match
    the saved names and shapes: a mismatch raises :class:`~rltrainer.checkpoints.CheckpointError`."""
    for name, model_state in models.items():
        found = saved_shapes(directory, f"models.{name}.")
        check_state_matches(f"{directory} ({name})", {k: tuple(v.shape) for k, v in model_state.items()}, found)
    from torch.distributed.checkpoint import load as dcp_load

    reader, planner = _safe_dcp()
    dcp_load(state, checkpoint_id=str(directory), storage_reader=reader(str(directory)), planner=planner())

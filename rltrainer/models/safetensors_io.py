"""Safetensors files, read and written tensor by tensor: :class:`SafetensorsWeights` reads rows of
one tensor of a model directory's files with plain file reads (no memory map), and
:func:`write_safetensors` writes a file one tensor at a time (views of one buffer included). Used
to load each rank's part of a checkpoint, to export, and by megatron's checkpoints."""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # the format's dtype names
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class SafetensorsWeights:
    """The ``*.safetensors`` files of a model directory. :meth:`read` reads rows of one tensor with
    plain file reads, straight into the destination when it can: only those bytes are read, and no
    file is memory-mapped (mapped pages would count in the process's resident memory)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            present = sorted(os.listdir(path))
            raise FileNotFoundError(
                f"{path} holds no *.safetensors file (it has: {', '.join(present[:12]) or 'nothing'}"
                f"{', ...' if len(present) > 12 else ''}). Sharded strategies load a checkpoint from its safetensors "
                "files only: save it with save_pretrained(path) (safetensors is its default), or convert its "
                "*.bin / *.pt files.")
        self._entries: dict[str, tuple[str, int, torch.dtype, tuple[int, ...]]] | None = None
        self.bytes_read = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> SafetensorsWeights:
        return self

    def names(self) -> dict[str, tuple[str, int, torch.dtype, tuple[int, ...]]]:
        """Tensor name -> (file, offset of its first byte, dtype, shape), from the files' headers."""
        if self._entries is None:
            self._entries = {}
            for file in self.files:
                with open(file, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(size))
                for name, entry in header.items():
                    if name == "__metadata__":
                        continue
                    if entry["dtype"] not in _DTYPES:
                        raise ValueError(f"{file}: tensor {name!r} has dtype {entry['dtype']}; readable dtypes are "
                                         f"{', '.join(_DTYPES)}")
                    self._entries[name] = (file, 8 + size + entry["data_offsets"][0],
                                           _DTYPES[entry["dtype"]], tuple(entry["shape"]))
        return self._entries

    def find(self, aliases: list[str]) -> str:
        """The first of ``aliases`` (a parameter's names, tied ones included) in the checkpoint."""
        return find_tensor(aliases, self.names(), self.path)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.names()[name][3]

    def dtype(self) -> torch.dtype | None:
        """The first floating tensor's dtype (transformers' ``dtype="auto"`` when config.json has none)."""
        return next((e[2] for e in self.names().values() if e[2].is_floating_point), None)

    def read(self, name: str, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` (all by default), into ``out`` if given (cast and
        moved as needed; read in place when it is a contiguous CPU tensor of the file's dtype)."""
        file, offset, dtype, shape = self.names()[name]
        row = math.prod(shape[1:]) * dtype.itemsize
        stop = (shape[0] if shape else 1) if stop is None else stop
        rows = (stop - start, *shape[1:]) if shape else ()
        direct = out is not None and out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(rows, dtype=dtype)
        buffer = memoryview(target.view(-1).view(torch.uint8).numpy()) if target.numel() else memoryview(b"")
        with open(file, "rb", buffering=0) as f:
            f.seek(offset + start * row)
            done = 0
            while done < len(buffer):  # large reads may return short
                got = f.readinto(buffer[done:])
                if not got:
                    raise ValueError(f"{file} ends inside tensor {name!r}: the file is truncated")
                done += got
        self.bytes_read += len(buffer)
        if out is not None and not direct:
            return out.copy_(target)
        return target


def find_tensor(aliases: list[str], names: Any, where: str) -> str:
    for name in aliases:
        if name in names:
            return name
    some = ", ".join(sorted(names)[:6])
    raise KeyError(f"{where} has no tensor {' or '.join(map(repr, aliases))}, which the model built from its config "
                   f"needs; it holds {len(names)} tensors ({some}, ...). Is it a checkpoint of this architecture?")


def write_safetensors(path: Path, tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Write ``tensors`` as one safetensors file (the format's header, then each tensor's bytes in
    order, copied to the file one at a time); returns the bytes of tensor data. Unlike
    ``safetensors.torch.save_file`` it accepts views of one buffer (a weight-sync bucket)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in _NAMES:
            raise TypeError(f"{name!r} is {tensor.dtype}; safetensors holds {', '.join(map(str, _NAMES))}")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, tensor in tensors:
            data = tensor.detach().to("cpu").contiguous()
            if data.numel():
                f.write(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return offset

"""A LoRA adapter as the production engines load it: a peft directory on local disk.

vLLM (``LLMEngine.add_lora(LoRARequest(name, int_id, path))``, then ``generate(...,
lora_request=...)``) and SGLang (``Engine.load_lora_adapter(name, path)``, then ``generate(...,
lora_path=[name, ...])``) load adapters from ``adapter_config.json`` + ``adapter_model.safetensors``.
A sync delivers the adapter in peft's saved names (see :mod:`rltrainer.lora`), bucket by bucket;
:class:`AdapterFiles` keeps the latest tensors (small: the adapter alone) and, before the next
generation, writes them as a new version of the directory for the engine to load under a new
name, dropping the previous one.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch


def is_adapter_tensor(name: str) -> bool:
    """A synced name of the adapter (peft's saved form), not of the base model."""
    return name.startswith("base_model.model.") and (".lora_A." in name or ".lora_B." in name)


class AdapterFiles:
    """The adapter a LoRA sync delivers, written out for an engine that loads adapters from disk.

    Args:
        lora_config: the policy's ``peft.LoraConfig`` (written as ``adapter_config.json``), or that
            file's contents as a dict (:func:`adapter_config_dict`: an engine process without peft).
        max_rank: the engine's largest LoRA rank (vLLM's / SGLang's ``max_lora_rank``).
    """

    def __init__(self, lora_config: Any, max_rank: int) -> None:
        rank = lora_config["r"] if isinstance(lora_config, dict) else lora_config.r
        if rank > max_rank:
            raise ValueError(f"The policy's LoRA rank r={rank} exceeds the engine's max_lora_rank={max_rank}; "
                             f"construct the engine with max_lora_rank >= {rank}.")
        self.config = copy.deepcopy(lora_config)  # a peft.LoraConfig, or its adapter_config.json as a dict
        self.tensors: dict[str, torch.Tensor] = {}
        self.version = 0  # 1, 2, ...: the int id of the adapter last written (vLLM's lora_int_id)
        self.dirty = False
        self._root = Path(tempfile.mkdtemp(prefix="rltrainer-lora-"))

    def split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Keep (a CPU copy of) each adapter tensor; pass the base model's tensors on."""
        for name, tensor in weights:
            if is_adapter_tensor(name):
                self.tensors[name] = tensor.detach().to("cpu", copy=True)
                self.dirty = True
            else:
                yield name, tensor

    @property
    def name(self) -> str:
        return f"rltrainer-policy-v{self.version}"

    def write(self) -> tuple[str, int, str]:
        """Write the tensors as the next version; returns ``(name, int_id, path)`` of it."""
        from safetensors.torch import save_file

        self.version += 1
        path = self._root / self.name
        path.mkdir()
        save_file(self.tensors, str(path / "adapter_model.safetensors"))
        if isinstance(self.config, dict):  # an engine process without peft (another environment)
            (path / "adapter_config.json").write_text(json.dumps(self.config, indent=2))
        else:
            self.config.save_pretrained(str(path))
        self.dirty = False
        return self.name, self.version, str(path)

    def forget(self, version: int) -> None:
        """Delete version ``version``'s directory (once the engine has unloaded it)."""
        shutil.rmtree(self._root / f"rltrainer-policy-v{version}", ignore_errors=True)

    def cleanup(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)


class LoadsAdaptersFromDisk:
    """For an engine (a :class:`~rltrainer.rollout.engine.RolloutEngine` subclass, listed before it)
    built with ``enable_lora`` and ``max_lora_rank``: it loads LoRA adapters when ``enable_lora``,
    keeping the synced adapter in ``self._adapter`` (:class:`AdapterFiles`)."""

    enable_lora: bool
    max_lora_rank: int

    @property
    def loads_adapters(self) -> bool:
        return self.enable_lora

    def enable_adapters(self, lora_config: Any) -> None:
        if not self.enable_lora:
            super().enable_adapters(lora_config)  # type: ignore[misc]  # the engine's refusal
        self._adapter = AdapterFiles(lora_config, self.max_lora_rank)


def adapter_config_dict(lora_config: Any) -> dict[str, Any]:
    """``lora_config`` (a ``peft.LoraConfig``) as the ``adapter_config.json`` peft writes (sets as
    sorted lists, enums as their strings), for an engine whose process has no peft (another Python
    environment)."""
    config = lora_config.to_dict()
    config = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.items()}
    return json.loads(json.dumps(config, default=str))  # plain types: peft's enums are str subclasses

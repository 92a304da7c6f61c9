"""Export a saved checkpoint as a Hugging Face model directory, from the command line (the export
itself: :mod:`rltrainer.hf_export`, or :meth:`rltrainer.Trainer.save_hf` after or during ``fit``)::

    python -m rltrainer.export CHECKPOINT OUT --model MODEL [--tokenizer DIR] [--strategy fsdp2 --devices 2]

It builds ``GRPO(MODEL)`` on the strategy, restores the checkpoint through the Trainer
(:meth:`~rltrainer.Trainer.restore`, the same code that resumes training) and exports. ``MODEL`` is
what the run was given (a path, hub id or a directory holding the ``config.json``); a LoRA run also
needs ``--lora ADAPTER_DIR`` (a directory with its ``adapter_config.json``).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rltrainer.hf_export import (LORA_MODES, export_dir, save_adapter_dir, save_hf, save_pretrained_dir, staged,
                                 write_safetensors, write_shards)
from rltrainer.modules import GRPO
from rltrainer.trainer import Trainer

__all__ = ["LORA_MODES", "convert_checkpoint", "export_dir", "main", "save_adapter_dir", "save_hf",
           "save_pretrained_dir", "staged", "write_safetensors", "write_shards"]


# -- the command --------------------------------------------------------------------------------------
def _no_reward(completions: list[str], **columns: Any) -> list[float]:
    return [0.0] * len(completions)


def convert_checkpoint(checkpoint: str | Path, out: str | Path, model: str, tokenizer: str | None = None,
                       strategy: str = "single", devices: int = 1, lora: str | None = None,
                       lora_mode: str = "merged", dtype: torch.dtype | None = None) -> Path:
    """Export a saved checkpoint: build ``GRPO(model)`` on ``strategy``, restore ``checkpoint`` as a
    resume would (the policy and its AdamW state, GRPO's default optimizer), and :func:`save_hf`.
    ``lora``: the run's adapter directory or its ``adapter_config.json``."""
    from transformers import AutoConfig, AutoTokenizer

    spec: Any = model
    if os.path.isdir(model) and not any(Path(model).glob("*.safetensors")):
        spec = AutoConfig.from_pretrained(model)  # a config alone: the run was a random init
    tok = AutoTokenizer.from_pretrained(tokenizer or model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    lora_config = None
    if lora is not None:
        import peft

        lora_config = peft.LoraConfig.from_pretrained(str(Path(lora).parent if str(lora).endswith(".json") else lora))
    module = GRPO(spec, tok, reward_funcs=_no_reward, lora=lora_config)
    trainer = Trainer(strategy=strategy, devices=devices, logger=False, enable_progress_bar=False, max_steps=1)
    try:
        trainer.restore(module, checkpoint)
        return trainer.save_hf(out, dtype=dtype, lora=lora_mode)
    finally:
        trainer.teardown()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rltrainer.export",
                                     description="Export a rltrainer checkpoint as a Hugging Face model directory.")
    parser.add_argument("checkpoint", help="a checkpoint ModelCheckpoint or Trainer.save_checkpoint wrote")
    parser.add_argument("out", help="the directory to write (new or empty)")
    parser.add_argument("--model", required=True, help="the model the run was given: path, hub id, or a config dir")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    parser.add_argument("--strategy", default="single", help="the strategy to restore on (default: single)")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--lora", default=None, help="a LoRA run: its adapter directory (adapter_config.json)")
    parser.add_argument("--lora-mode", choices=LORA_MODES, default="merged")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    convert_checkpoint(args.checkpoint, args.out, args.model, args.tokenizer, args.strategy, args.devices,
                       args.lora, args.lora_mode, getattr(torch, args.dtype) if args.dtype else None)


if __name__ == "__main__":
    main()

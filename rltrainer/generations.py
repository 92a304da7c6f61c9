"""Sample generations in the logs: the :class:`LogGenerations` callback (on by default; configure it
by passing one, ``Trainer(callbacks=[LogGenerations(every_n_steps=N, rows=K)])``) sends, every ``N``
steps and at every validation, ``K`` rows to each logger in the form it supports:

===================  ====================================================================
logger               what it gets
===================  ====================================================================
``CSVLogger``        one JSON line per row in ``generations.jsonl``, beside ``metrics.csv``
``TensorBoardLogger`` a Markdown table as text (``add_text``, tag ``generations/<split>``)
``WandbLogger``      a table (``log_table``, key ``generations/<split>``)
``MLFlowLogger``     a JSON artifact ``generations/<split>_step<N>.json`` (``log_dict``)
anything else        its ``log_generations(rows, step, split)`` method, if it has one
===================  ====================================================================

A row has ``prompt``, ``response``, ``reward``, ``advantage`` (the row's mean over its response
tokens; ``None`` at validation), ``finish_reason`` and each reward function's unweighted score
(``reward/<name>``). Lines in ``generations.jsonl`` also carry ``step`` and ``split``
(``"train"`` or ``"val"``).

``prompt`` is what the model saw, decoded from the row's prompt tokens (a chat template applied in
``rollout_step`` shows). In a multi-turn row (:class:`~rltrainer.envs.MultiTurn`) ``prompt`` is the
environment's first observation as rendered, and ``response`` the whole episode after it, decoded
from its tokens with the chat markers: the model's turns and, between them, the environment's
replies and tool results, exactly as the model saw them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.callbacks.callback import Callback
from rltrainer.data.batch import RolloutBatch
from rltrainer.files import append_bytes
from rltrainer.values import check_int

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer

log = logging.getLogger(__name__)

COLUMNS = ("prompt", "response", "reward", "advantage", "finish_reason")


class LogGenerations(Callback):
    """Send sample generations to the loggers: ``rows`` rows of every ``every_n_steps``-th training
    step (spread over its groups), and the first ``rows`` rows of every validation. On by default
    (``every_n_steps=50, rows=4``); pass one to configure it, ``LogGenerations(every_n_steps=None)``
    to log none.

    The step keeps rows through :meth:`rltrainer.RLModule.record_generations` (the loop after
    ``advantage_step``, the default ``validation_step``; a custom ``validation_step`` may call it
    too); they are written at the end of the step and of the validation."""

    def __init__(self, every_n_steps: int | None = 50, rows: int = 4) -> None:
        every_n_steps = check_int("every_n_steps", every_n_steps, at_least=1, none="never", owner="LogGenerations")
        rows = check_int("rows", rows, at_least=1, meaning="rows per logged step", owner="LogGenerations")
        self.every_n_steps, self.rows = every_n_steps, rows
        self._kept: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}  # rows to write, per split

    def record(self, trainer: Trainer, batch: RolloutBatch, split: str) -> None:
        """Keep sample rows of a scored batch: ``split="train"`` on the steps that log them, ``"val"``
        until ``rows`` are kept."""
        kept = self._kept[split]
        if not trainer.loggers or self.every_n_steps is None or len(kept) >= self.rows:
            return
        if split == "train" and (trainer.global_step + 1) % self.every_n_steps:
            return
        want = self.rows - len(kept)
        indices = spread(len(batch), want) if split == "train" else list(range(min(want, len(batch))))
        kept.extend(generation_rows(batch, trainer.module.tokenizer, indices))

    def write(self, trainer: Trainer, split: str) -> None:
        """Send the rows kept for ``split`` to the loggers, at the trainer's step."""
        rows, self._kept[split] = self._kept[split], []
        write_generations(trainer.loggers, rows, trainer.global_step, split)

    def on_step_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        self.write(trainer, "train")

    def on_validation_start(self, trainer: Trainer, module: RLModule) -> None:
        self.write(trainer, "train")  # a validation inside a step: the step's rows come first
        self._kept["val"] = []

    def on_validation_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        self.write(trainer, "val")


def generation_rows(batch: RolloutBatch, tokenizer: Any, indices: list[int]) -> list[dict[str, Any]]:
    """The rows ``indices`` of a rolled-out (and scored) batch as plain dicts for the loggers."""
    names = batch.reward_components
    components = batch["reward_components"] if "reward_components" in batch and names else None  # [N, F]
    advantages = row_advantages(batch)  # [N] or None
    out = []
    for i in indices:
        row: dict[str, Any] = {
            "prompt": seen_prompt(batch, i, tokenizer),
            "response": episode_text(batch, i, tokenizer) if "env_turns" in batch else
            str(batch["response_text"][i]) if "response_text" in batch else None,
            "reward": float(batch["scores"][i]) if "scores" in batch else None,
            "advantage": float(advantages[i]) if advantages is not None else None,
            "finish_reason": str(batch["finish_reason"][i]) if "finish_reason" in batch else None,
        }
        if components is not None:
            row.update({f"reward/{name}": float(components[i, k]) for k, name in enumerate(names)})
        out.append(row)
    return out


def seen_prompt(batch: RolloutBatch, i: int, tokenizer: Any) -> str | None:
    """Row ``i``'s prompt as the model saw it: its ``prompts`` tokens (padding left out), else the
    dataset's ``prompt_ids``."""
    if "prompts" in batch and "attention_mask" in batch:
        P = batch["prompts"].shape[1]
        return tokenizer.decode(batch["prompts"][i][batch["attention_mask"][i, :P].bool()].tolist())
    return tokenizer.decode(list(batch["prompt_ids"][i])) if "prompt_ids" in batch else None


def episode_text(batch: RolloutBatch, i: int, tokenizer: Any) -> str:
    """A multi-turn row's response tokens (model turns and environment turns), decoded with the
    chat markers."""
    P = batch["prompts"].shape[1]
    return tokenizer.decode(batch["responses"][i][batch["attention_mask"][i, P:].bool()].tolist())


def row_advantages(batch: RolloutBatch) -> torch.Tensor | None:
    """``[N]``: each row's advantage averaged over its response tokens (0 for a row without any)."""
    if "advantages" not in batch:
        return None
    mask = batch["response_mask"].float()  # [N, T]
    return (batch["advantages"].float() * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]


def spread(n: int, k: int) -> list[int]:
    """``k`` row indices spread evenly over ``n`` rows (so several groups show, not one)."""
    if n <= k:
        return list(range(n))
    return sorted({round(j * (n - 1) / (k - 1)) for j in range(k)}) if k > 1 else [0]


def write_generations(loggers: list[Any], rows: list[dict[str, Any]], step: int, split: str) -> None:
    """Send ``rows`` to every logger that can take them (see the module docstring)."""
    if not rows:
        return
    for logger in loggers:
        kinds = {cls.__name__ for cls in type(logger).__mro__}
        if "CSVLogger" in kinds:
            logger.experiment  # noqa: B018 - creates the log directory as the logger wants it, first
            write_jsonl(Path(logger.log_dir) / "generations.jsonl", rows, step, split)
        elif "TensorBoardLogger" in kinds:
            logger.experiment.add_text(f"generations/{split}", markdown_table(rows), global_step=step)
        elif "WandbLogger" in kinds:
            columns = list(rows[0])
            logger.log_table(key=f"generations/{split}", columns=columns,
                             data=[[row.get(c) for c in columns] for row in rows], step=step)
        elif "MLFlowLogger" in kinds:
            logger.experiment.log_dict(logger.run_id, {"step": step, "split": split, "rows": rows},
                                       f"generations/{split}_step{step:06d}.json")
        elif hasattr(logger, "log_generations"):
            logger.log_generations(rows, step, split)


def write_jsonl(path: Path, rows: list[dict[str, Any]], step: int, split: str) -> None:
    """Append one JSON line per row (with ``step`` and ``split``) to ``path``, in one write (never half a line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"step": step, "split": split, **row}, ensure_ascii=False) + "\n" for row in rows)
    append_bytes(path, lines.encode("utf-8"), f"{len(rows)} generation row(s)")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (TensorBoard renders it); ``|`` and newlines escaped."""
    columns = list(rows[0])

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)
        return text.replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)

"""Sample generations in the logs: every ``Trainer(log_generations_every_n_steps=N)`` steps and at
every validation, ``K`` rows go to each logger in the form it supports:

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
from typing import Any

import torch

from rltrainer.data.batch import RolloutBatch
from rltrainer.files import append_bytes

log = logging.getLogger(__name__)

COLUMNS = ("prompt", "response", "reward", "advantage", "finish_reason")


def generation_rows(batch: RolloutBatch, tokenizer: Any, indices: list[int]) -> list[dict[str, Any]]:
    """The rows ``indices`` of a rolled-out (and scored) batch as plain dicts for the loggers."""
    names = batch.meta.get("reward_components", [])
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

"""The hooks' contracts, declared once: what each hook returns, checked where its result comes back
(by :func:`check_hook_result`), and rendered as the documentation's table (:func:`markdown_table`).

A hook that breaks its contract (forgets ``return batch``, returns advantages ``[N]`` instead of
``[N, T]``, scores as a Python list, only the loss) would otherwise fail somewhere else, in words
that name neither the hook nor what was expected. The checks here look at types, shapes and dtypes
only (no loop over rows), so they cost nothing next to the step.

Shapes are written in letters: ``N`` the rows the hook received (a micro-batch's on the training
ranks), ``B`` prompt rows, ``P`` prompt length, ``T`` response length, ``F`` reward functions.
``P`` and ``T`` are read from the batch (``prompts`` and ``responses``); a letter the batch cannot
size is not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rltrainer.data.batch import RolloutBatch

#: what a dtype kind accepts, and how the docs write it
KINDS = {"float": "float", "int": "int", "mask": "int or bool", "bool": "bool", "any": "any"}


class HookContractError(TypeError, ValueError):
    """A hook returned something its contract does not allow. A ``TypeError`` and a ``ValueError``
    both, so code that caught either before still does."""


@dataclass(frozen=True)
class Field:
    """One field a hook adds: ``shape`` in letters (``"N, T"``; ``""`` for a non-tensor, one entry
    per row), dtype ``kind`` (a key of :data:`KINDS`), whether it is ``required`` (an optional field
    is checked when present) and a ``fix`` for the message when it is wrong."""

    name: str
    shape: str
    kind: str
    required: bool = True
    meaning: str = ""
    fix: str = ""

    def describe(self) -> str:
        shape = f" [{self.shape}]" if self.shape else " (list, one per row)"
        kind = f" {KINDS[self.kind]}" if self.shape else ""
        return f"{self.name}{shape}{kind}"


@dataclass(frozen=True)
class HookContract:
    """A hook: its signature, where it runs, what it reads, and what it returns or adds."""

    hook: str
    signature: str
    runs_on: str
    reads: str
    returns: str
    adds: tuple[Field, ...] = ()


ROLLOUT_FIELDS = (
    Field("prompts", "N, P", "int", meaning="prompt token ids, left-padded"),
    Field("responses", "N, T", "int", meaning="response token ids, right-padded"),
    Field("response_mask", "N, T", "mask", meaning="1 on generated tokens"),
    Field("input_ids", "N, P+T", "int", meaning="cat(prompts, responses)"),
    Field("attention_mask", "N, P+T", "mask", meaning="1 on real tokens"),
    Field("position_ids", "N, P+T", "int", meaning="cumsum(attention_mask) - 1"),
    Field("rollout_log_probs", "N, T", "float", required=False, meaning="the engine's log-probs"),
    Field("policy_version", "N", "int", required=False, meaning="weights version (the pipeline sets it if absent)"),
    Field("uid", "", "any", meaning="group id: the rows of one prompt share it"),
    Field("response_text", "", "any", meaning="decoded response"),
)

#: what each compute stage adds (a stage not listed here: tensors with ``N`` rows)
STAGE_FIELDS = {
    "old_log_prob": Field("old_log_probs", "N, T", "float", meaning="stage old_log_prob"),
    "ref": Field("ref_log_probs", "N, T", "float", meaning="stage ref"),
    "values": Field("values", "N, T", "float", meaning="stage values (a critic)"),
    "teacher": Field("teacher_log_probs", "N, T", "float", meaning="stage teacher"),
    "reward_model": Field("rm_scores", "N", "float", meaning="stage reward_model"),
}

CONTRACTS: dict[str, HookContract] = {c.hook: c for c in (
    HookContract(
        "rollout_step", "rollout_step(self, batch, engine) -> RolloutBatch", "controller (maybe a pipeline thread)",
        "prompt_ids (token ids per prompt row), prompt_position [B, 3], the dataset's columns",
        "the batch of N = B*G rows (samples of a prompt adjacent)", ROLLOUT_FIELDS),
    HookContract(
        "reward_step", "reward_step(self, batch) -> RolloutBatch", "controller",
        "response_text, responses, response_mask, the dataset's columns", "the batch it received (N rows)",
        (Field("scores", "N", "float", meaning="total reward per row",
               fix="set batch['scores'] = torch.tensor(values, dtype=torch.float32)"),
         Field("reward_components", "N, F", "float", required=False, meaning="each reward function's score"),
         Field("reward_invalid", "N", "bool", required=False, meaning="rows a reward scored NaN/inf"),
         Field("token_level_scores", "N, T", "float", required=False, meaning="per-token rewards"))),
    HookContract(
        "compute_step", "compute_step(self, micro_batch, stage) -> dict[str, Tensor]",
        "every training rank, per micro-batch, no grad",
        "input_ids, attention_mask, position_ids, responses, response_mask",
        "a dict of tensors with N rows, the stage's field among them", tuple(STAGE_FIELDS.values())),
    HookContract(
        "advantage_step", "advantage_step(self, batch) -> RolloutBatch", "controller, the whole batch",
        "scores, response_mask, uid, the compute stages' fields", "the batch it received (N rows)",
        (Field("advantages", "N, T", "float", meaning="per-token advantages, 0 on padding",
               fix="a per-row advantage a [N] becomes a.unsqueeze(-1) * batch['response_mask']"),
         Field("returns", "N, T", "float", required=False, meaning="value targets (a critic)"))),
    HookContract(
        "policy_step", "policy_step(self, micro_batch) -> tuple[Tensor, dict[str, float]]",
        "every training rank, per micro-batch, with grad",
        "the rollout fields, advantages, the stages' fields; meta: global_tokens, global_rows",
        "(loss, metrics): loss a 0-d float tensor that requires grad; metrics a dict of numbers or 0-d tensors"),
    HookContract(
        "validation_step", "validation_step(self, batch, engine) -> dict[str, float]", "controller",
        "prompt_ids, the dataset's columns",
        "a dict of numbers (val/* metrics, and val/rows: the rows they average over)"),
)}


# -- checks ---------------------------------------------------------------------------------------------
def check_hook_result(module: Any, hook: str, result: Any, received: Any = None, stage: str | None = None) -> Any:
    """Return ``result`` if it keeps ``hook``'s contract; raise :class:`HookContractError` naming the
    hook, the field, what was expected and what came back otherwise. ``received``: the batch the
    hook was given (its rows and sizes); ``stage``: ``compute_step``'s stage."""
    where = f"{type(module).__name__}.{hook}" + (f"(stage={stage!r})" if stage else "")
    if hook == "policy_step":
        _check_policy_output(where, result)
    elif hook == "validation_step":
        _check_metrics(where, result, "the validation metrics", "return {'val/score': ..., 'val/rows': float(rows)}")
    elif hook == "compute_step":
        _check_compute_output(where, result, received, stage)
    else:
        _check_batch(where, hook, result, received)
    return result


def _check_batch(where: str, hook: str, result: Any, received: Any) -> None:
    contract = CONTRACTS[hook]
    if result is None:
        raise HookContractError(f"{where} returned None; it must return {contract.returns} with "
                                f"{_required(contract)}. Did it forget `return batch`?")
    if not isinstance(result, RolloutBatch):
        raise HookContractError(f"{where} returned a {type(result).__name__}; it must return a RolloutBatch: "
                                f"{contract.returns} with {_required(contract)}.")
    if hook != "rollout_step" and received is not None and len(result) != len(received):
        raise HookContractError(f"{where} returned {len(result)} rows for the {len(received)} it received; it "
                                f"must return {contract.returns}, row for row.")
    sizes = batch_sizes(result)
    for field in contract.adds:
        check_field(where, result, field, sizes)


def batch_sizes(batch: Any) -> dict[str, int]:
    """The letters a batch sizes: ``N`` its rows, ``P`` from ``prompts``, ``T`` from ``responses``."""
    sizes = {"N": len(batch)}
    for letter, name in (("P", "prompts"), ("T", "responses")):
        value = batch.get(name)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            sizes[letter] = int(value.shape[1])
    if "P" in sizes and "T" in sizes:
        sizes["P+T"] = sizes["P"] + sizes["T"]
    return sizes


def check_field(where: str, batch: Any, field: Field, sizes: dict[str, int]) -> None:
    """Raise if ``field`` is missing (and required), not a tensor, or of the wrong shape or dtype."""
    if field.name not in batch:
        if field.required:
            raise HookContractError(f"{where} returned a batch without {field.name!r}; expected {field.describe()}"
                                    f"{_meaning(field)}. It has {batch.keys()}.{_fix(field)}")
        return
    value = batch[field.name]
    if not field.shape:  # a non-tensor: one entry per row, which RolloutBatch already enforces
        return
    if not isinstance(value, torch.Tensor):
        got = f"a Python list or numpy array (a non-tensor field: {_preview(value)})"
        raise HookContractError(f"{where} returned {field.name!r} as {got}; expected a tensor {field.describe()}"
                                f"{_meaning(field)}.{_fix(field)}")
    expected = [s.strip() for s in field.shape.split(",")]
    sized = [str(sizes[s]) if s in sizes else s for s in expected]
    wrong_shape = value.dim() != len(expected) or any(
        s in sizes and value.shape[i] != sizes[s] for i, s in enumerate(expected))
    if wrong_shape:
        raise HookContractError(
            f"{where} returned {field.name!r} of shape [{', '.join(map(str, value.shape))}]; expected "
            f"{field.describe()} = [{', '.join(sized)}]{_meaning(field)}.{_fix(field)}")
    if not dtype_fits(value.dtype, field.kind):
        raise HookContractError(f"{where} returned {field.name!r} of dtype {str(value.dtype).replace('torch.', '')}; "
                                f"expected {KINDS[field.kind]} ({field.describe()}).{_fix(field)}")


def dtype_fits(dtype: torch.dtype, kind: str) -> bool:
    if kind == "float":
        return dtype.is_floating_point
    if kind == "bool":
        return dtype == torch.bool
    if kind in ("int", "mask"):
        return not dtype.is_floating_point and not dtype.is_complex and (kind == "mask" or dtype != torch.bool)
    return True


def _check_compute_output(where: str, result: Any, received: Any, stage: str | None) -> None:
    field = STAGE_FIELDS.get(stage or "")
    expected = f"a dict of tensors with the micro-batch's rows first{f', with {field.describe()}' if field else ''}"
    if not isinstance(result, Mapping):
        got = "None" if result is None else f"a {type(result).__name__}"
        raise HookContractError(f"{where} returned {got}; expected {expected}, e.g. "
                                f"{{'{field.name if field else 'my_field'}': tensor}}.")
    sizes = batch_sizes(received) if received is not None else {}
    for name, value in result.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or ("N" in sizes and value.shape[0] != sizes["N"]):
            got = f"shape [{', '.join(map(str, value.shape))}]" if isinstance(value, torch.Tensor) else \
                f"a {type(value).__name__}"
            raise HookContractError(f"{where} returned {name!r} as {got}; expected {expected} "
                                    f"({sizes.get('N', 'N')} rows).")
    if field is not None:
        check_field(where, RolloutBatch(dict(result), batch_size=sizes.get("N")), field, sizes)


def _check_policy_output(where: str, result: Any) -> None:
    contract = CONTRACTS["policy_step"]
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = (f"only a tensor of shape [{', '.join(map(str, result.shape))}]" if isinstance(result, torch.Tensor)
               else "None" if result is None else f"a {type(result).__name__}"
               + (f" of {len(result)} items" if isinstance(result, (tuple, list)) else ""))
        raise HookContractError(f"{where} returned {got}; expected {contract.returns}, e.g. "
                                f"`return loss, {{'actor/pg_loss': loss.detach()}}` (or `return loss, {{}}`).")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.dtype.is_floating_point:
        got = (f"a {str(loss.dtype).replace('torch.', '')} tensor of shape [{', '.join(map(str, loss.shape))}]"
               if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__} ({_preview(loss)})")
        raise HookContractError(f"{where} returned a loss that is {got}; expected a 0-d float tensor (reduce it: "
                                f"sum over tokens / micro_batch.global_tokens).")
    if not loss.requires_grad:
        raise HookContractError(f"{where} returned a loss that does not require grad (computed under no_grad, "
                                f"detached, or with .item()); expected a 0-d float tensor built from the policy's "
                                f"forward, so backward() reaches its weights.")
    _check_metrics(where, metrics, "the metrics (second item)", "return loss, {'actor/pg_loss': loss.detach()}")


#: The count metrics ``policy_step`` may return as tensors (a MoE policy's, per layer and expert):
#: summed element by element over micro-batches, ranks and optimizer steps, then summarised into
#: numbers (:func:`rltrainer.models.moe.summarize_routing_metrics`).
COUNT_METRICS = frozenset({"moe/expert_tokens", "moe/router_entropy", "moe/routing_agreement"})


def _check_metrics(where: str, metrics: Any, what: str, example: str) -> None:
    if not isinstance(metrics, Mapping):
        got = "None" if metrics is None else f"a {type(metrics).__name__}"
        raise HookContractError(f"{where} returned {got} as {what}; expected a dict of numbers, e.g. `{example}`.")
    for name, value in metrics.items():
        number = isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)
        number = number or (name in COUNT_METRICS and isinstance(value, torch.Tensor))
        if not isinstance(name, str) or not number:
            got = (f"a tensor of shape [{', '.join(map(str, value.shape))}]" if isinstance(value, torch.Tensor)
                   else f"a {type(value).__name__}")
            raise HookContractError(f"{where} returned {what} with {name!r}: {got}; expected str names and numbers "
                                    f"(floats or 0-d tensors).")


def _required(contract: HookContract) -> str:
    return ", ".join(f.describe() for f in contract.adds if f.required)


def _meaning(field: Field) -> str:
    return f" ({field.meaning})" if field.meaning else ""


def _fix(field: Field) -> str:
    return f" Fix: {field.fix}." if field.fix else ""


def _preview(value: Any, limit: int = 60) -> str:
    text = f"{type(value).__name__} {value!r}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the documentation's table ---------------------------------------------------------------------------
def markdown_table() -> str:
    """The contract as a Markdown table (the docs page ``hooks.md`` holds it verbatim; a test checks)."""
    lines = ["| hook | runs on | reads | returns | fields it must add | optional fields |",
             "|---|---|---|---|---|---|"]
    for c in CONTRACTS.values():
        per_stage = c.hook == "compute_step"
        required = "<br>".join(f"`{f.describe()}`" + (f" ({f.meaning})" if per_stage else "")
                               for f in c.adds if f.required) or "-"
        optional = "<br>".join(f"`{f.describe()}`" for f in c.adds if not f.required) or "-"
        lines.append(f"| `{c.signature}` | {c.runs_on} | {c.reads} | {c.returns} | {required} | {optional} |")
    return "\n".join(lines)

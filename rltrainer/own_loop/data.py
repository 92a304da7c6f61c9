"""Tinker's data shape, ``Datum``, and its layout as a :class:`~rltrainer.data.batch.RolloutBatch`.

A datum is one sequence: ``model_input`` (``N`` tokens) and ``loss_fn_inputs``, each ``[N]`` with
next-token alignment (position ``i`` of ``model_input`` predicts ``target_tokens[i]``): ``target_tokens``
(int), and as the loss needs ``weights``, ``advantages``, ``logprobs`` (the sampler's),
``sequence_ratio_mask`` (``gspo``'s). The SDK's own
``tinker.Datum`` is accepted as it is (its ``ModelInput`` and ``TensorData``), as is a plain dict of
tensors or lists.

As a batch, a datum is a row whose one-token "prompt" is ``model_input[0]`` and whose "response" is
``target_tokens`` (``T`` = the longest ``N``): ``input_ids = model_input + [target_tokens[-1]]``, so
position ``i`` of the forward reads ``model_input[: i + 1]`` and the response log-probs
(:func:`rltrainer.models.response_log_probs`) are exactly the log-probs of ``target_tokens``, even
where a target is not the next input token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrainer.data.batch import RolloutBatch

#: ``loss_fn_inputs`` laid out as ``[n, T]`` float fields of the batch (``tinker_<name>``).
FLOAT_INPUTS = ("weights", "advantages", "logprobs", "sequence_ratio_mask")


@dataclass
class Datum:
    """One training sequence: ``model_input [N]`` token ids and ``loss_fn_inputs`` (each ``[N]``)."""

    model_input: Sequence[int] | torch.Tensor
    loss_fn_inputs: Mapping[str, Any] = field(default_factory=dict)


def tokens_of(model_input: Any) -> list[int]:
    """A ``ModelInput`` (the SDK's: ``to_ints()``), a tensor or a list of ints -> a list of ints."""
    if hasattr(model_input, "to_ints"):
        return list(model_input.to_ints())
    if isinstance(model_input, torch.Tensor):
        return [int(t) for t in model_input.reshape(-1).tolist()]
    return [int(t) for t in model_input]


def as_tensor(value: Any) -> torch.Tensor:
    """A ``loss_fn_inputs`` value (the SDK's ``TensorData``, a tensor, numpy array or list) as a tensor."""
    if hasattr(value, "to_torch"):
        return value.to_torch()
    return torch.as_tensor(value)


def as_datums(data: Any) -> list[Datum]:
    """``data``: a list of datums (this module's, the SDK's, or dicts with ``model_input`` and
    ``loss_fn_inputs``), or one dict of ``[n, N]`` tensors (``model_input``, ``target_tokens`` and the
    loss's inputs; every row ``N`` long)."""
    if isinstance(data, Mapping):
        if "model_input" not in data or "target_tokens" not in data:
            raise ValueError(f"A dict of tensors needs 'model_input' and 'target_tokens' ([n, N] each); got "
                             f"{sorted(data)}")
        rows = as_tensor(data["model_input"])
        inputs = {k: as_tensor(v) for k, v in data.items() if k != "model_input"}
        return [Datum(rows[i], {k: v[i] for k, v in inputs.items()}) for i in range(rows.shape[0])]
    out = []
    for i, d in enumerate(data):
        if isinstance(d, Mapping):
            d = Datum(d["model_input"], d.get("loss_fn_inputs", {}))
        if not hasattr(d, "model_input") or not hasattr(d, "loss_fn_inputs"):
            raise TypeError(f"data[{i}] is a {type(d).__name__}; expected a Datum (model_input, loss_fn_inputs)")
        out.append(Datum(tokens_of(d.model_input), {k: as_tensor(v) for k, v in d.loss_fn_inputs.items()}))
    if not out:
        raise ValueError("forward_backward needs at least one datum")
    return out


def datums_batch(datums: list[Datum], loss_fn: str, loss_config: dict[str, float]) -> RolloutBatch:
    """The datums as rows (see the module docstring): ``prompts [n, 1]``, ``responses [n, T]`` (the
    targets), ``response_mask [n, T]``, ``input_ids``/``attention_mask``/``position_ids [n, 1+T]``,
    ``tinker_<input> [n, T]`` for every float input (``weights`` 1 where not given, the others 0); non-tensor ``loss_fn`` and ``loss_fn_config``
    per row (one call's)."""
    lengths = []
    for i, d in enumerate(datums):
        n = len(d.model_input)
        if n == 0:
            raise ValueError(f"data[{i}].model_input is empty")
        if "target_tokens" not in d.loss_fn_inputs:
            raise ValueError(f"data[{i}].loss_fn_inputs has no 'target_tokens' (got {sorted(d.loss_fn_inputs)})")
        for k, v in d.loss_fn_inputs.items():
            if tuple(v.shape) != (n,):
                raise ValueError(f"data[{i}].loss_fn_inputs[{k!r}] has shape {tuple(v.shape)}; expected ({n},), the "
                                 "model_input's length (2-D targets, e.g. distillation's top-k, are not supported)")
        lengths.append(n)
    rows, T = len(datums), max(lengths)
    input_ids = torch.zeros(rows, 1 + T, dtype=torch.long)
    attention = torch.zeros(rows, 1 + T, dtype=torch.long)
    responses = torch.zeros(rows, T, dtype=torch.long)
    mask = torch.zeros(rows, T, dtype=torch.long)
    floats = {k: torch.zeros(rows, T) for k in FLOAT_INPUTS}
    for i, (d, n) in enumerate(zip(datums, lengths)):
        targets = d.loss_fn_inputs["target_tokens"].long()
        input_ids[i, :n] = torch.tensor(d.model_input)
        input_ids[i, n] = targets[-1]
        attention[i, : n + 1] = 1
        responses[i, :n] = targets
        mask[i, :n] = 1
        for k, out in floats.items():
            if k in d.loss_fn_inputs:
                out[i, :n] = d.loss_fn_inputs[k].float()
            elif k == "weights":
                out[i, :n] = 1.0
    tensors = {"prompts": input_ids[:, :1], "responses": responses, "response_mask": mask, "input_ids": input_ids,
               "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
               **{f"tinker_{k}": v for k, v in floats.items()}}
    return RolloutBatch(tensors, non_tensors={"loss_fn": [loss_fn] * rows, "loss_fn_config": [loss_config] * rows})


def batch_inputs(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """The ``tinker_<input>`` fields of ``batch`` by input name."""
    return {k: batch[f"tinker_{k}"] for k in FLOAT_INPUTS}


def per_datum(values: torch.Tensor, batch: RolloutBatch) -> list[torch.Tensor]:
    """``values [n, T]`` cut to each row's length: ``n`` tensors ``[N_i]``."""
    lengths = batch["response_mask"].sum(1).tolist()
    return [values[i, : int(n)].clone() for i, n in enumerate(lengths)]

"""Padding-free forward passes: the rows of a micro-batch packed into one sequence.

A micro-batch holds rows ``input_ids [n, P+T]``: prompts left-padded, responses right-padded, so
the padded forward spends its compute on every pad position. :func:`pack_rows` keeps only each
row's real tokens (``attention_mask == 1``), one row after the other, as ``input_ids [1, L]`` with
``position_ids`` restarting at 0 for each row and no attention mask. transformers (5.x) reads the
row boundaries from the restarts: ``masking_utils.find_packed_sequence_indices`` builds a
block-diagonal causal mask for sdpa and eager attention, and the flash-attention kernels run
varlen on ``cu_seq_lens_q`` / ``cu_seq_lens_k``, which :func:`pack_rows` passes (so they are not
inferred from the positions). Every token keeps the positions of the padded path, so the outputs
are the padded path's within rounding. TRL calls this ``padding_free``, verl ``use_remove_padding``.

The outputs that predict response tokens are picked from the packed sequence
(:attr:`PackedRows.predictors`) and put back in ``[n, T]`` by :meth:`PackedRows.unpack`, with 0
at response padding (the padded path leaves values there that every loss masks out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch


@dataclasses.dataclass
class PackedRows:
    """A micro-batch's rows as one packed sequence (see the module docstring)."""

    inputs: dict[str, Any]  # model kwargs: input_ids [1, L], position_ids [1, L], attention_mask None (+ varlen)
    predictors: torch.Tensor  # [M]: packed positions whose output predicts a real response token
    rows: torch.Tensor  # [M]: that token's row
    cols: torch.Tensor  # [M]: that token's response column
    shape: tuple[int, int]  # (n, T)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``values [M, ...]`` (one per predicted response token) as ``[n, T, ...]``, 0 elsewhere."""
        out = values.new_zeros((*self.shape, *values.shape[1:]))
        return out.index_put((self.rows, self.cols), values)


def pack_rows(batch: Mapping[str, torch.Tensor], response_length: int, varlen: bool = False) -> PackedRows:
    """Pack the real tokens of ``batch`` (``input_ids``, ``attention_mask``, ``position_ids``, all
    ``[n, P+T]``) whose last ``response_length`` columns are the responses. With ``varlen`` the
    inputs carry flash-attention's ``cu_seq_lens_q/k`` and ``max_length_q/k``.

    Raises if ``position_ids`` are not ``cumsum(attention_mask) - 1`` on the real tokens (the
    :class:`~rltrainer.data.batch.RolloutBatch` layout): packing starts every row at position 0."""
    mask = batch["attention_mask"].bool()  # [n, P+T]
    n, width = mask.shape
    T = response_length
    if not 0 < T < width:
        raise ValueError(f"pack_rows needs responses inside the rows: response_length={T}, rows of {width} tokens")
    positions = mask.long().cumsum(1) - 1  # [n, P+T]
    given = batch["position_ids"]
    if not torch.equal(given[mask], positions[mask].to(given.dtype)):
        raise ValueError("padding_free packs each row with position_ids restarting at 0 (cumsum(attention_mask) - 1, "
                         "the RolloutBatch layout), but this micro-batch's position_ids differ on real tokens. "
                         "Build position_ids from the attention mask, or turn padding_free off.")
    packed_index = mask.flatten().long().cumsum(0).view(n, width) - 1  # [n, P+T]: where each real token lands
    real = mask[:, width - T:] & mask[:, width - T - 1:-1]  # [n, T]: a real response token with a real predecessor
    rows, cols = real.nonzero(as_tuple=True)
    predictors = packed_index[:, width - T - 1:-1][real]  # [M], row-major as nonzero
    inputs: dict[str, Any] = {"input_ids": batch["input_ids"][mask][None], "position_ids": positions[mask][None],
                              "attention_mask": None}
    if varlen:
        lengths = mask.sum(1)
        lengths = lengths[lengths > 0]
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        longest = int(lengths.max()) if len(lengths) else 0
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return PackedRows(inputs, predictors, rows, cols, (n, T))


def uses_flash_attention(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs a flash-attention kernel (which takes the varlen kwargs)."""
    config = getattr(model, "config", None)
    return "flash" in str(getattr(config, "_attn_implementation", None) or "")


def packed_rows_for(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> PackedRows:
    """:func:`pack_rows` of ``batch`` (responses: ``batch["responses"]``) for ``model``'s attention."""
    return pack_rows(batch, batch["responses"].shape[1], varlen=uses_flash_attention(model))

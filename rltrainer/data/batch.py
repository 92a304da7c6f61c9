"""The one batch type passed between stages (verl's ``DataProto`` role), built on tensordict.

A :class:`RolloutBatch` has three parts:

- ``tensors``: a :class:`tensordict.TensorDict` whose batch dimension is ``N`` rows;
- ``non_tensors``: a dict of numpy object arrays of length ``N`` (text, ground truth, ...);
- typed batch-level fields (:data:`BATCH_FIELDS`), each set where it is known and read where
  it is used (no string keys between stages):

  ========================  ===================  ==============================================
  field                     set by               meaning
  ========================  ===================  ==============================================
  ``padding_free``          the Strategy         the micro-batch's forward runs its rows packed
                                                 into one sequence (:mod:`rltrainer.packing`)
  ``padding``               the Strategy         a padding micro-batch (multi-rank: a rank short
                                                 of rows); its loss counts 0
  ``global_tokens``         the loop             response tokens of the whole mini-batch: the
                                                 loss's normaliser (see ``policy_step``)
  ``global_rows``           the loop             rows of the whole mini-batch
  ``temperature``           ``rollout_step``     the sampling temperature of the rows (None: 1.0)
  ``rollout_metrics``       ``rollout_step``     the engine's figures (``rollout/gen_time_s``...)
  ``env_metrics``           an environment       its ``env/*`` figures, logged by ``rollout_step``
  ``logged``                the pipeline         step metrics the rows carry: what ``rollout_step``
                                                 logged, ``timing_s/gen``, ``pipeline/*``
  ``reward_components``     ``reward_step``      the names of ``reward_components [N, F]``
  ``loss_extras``           the loss part        fields its ``prepare`` added for the update
  ``correct_in_update``     the correction part  the update recomputes the IS weights
  ========================  ===================  ==============================================

- ``meta``: a plain dict for a module's own batch-level values (none of the library's).

Indexing with a string returns a field; indexing with an int, slice, list or tensor returns the
sub-batch of those rows, with every field sliced alike.

Field names and shapes (letters: ``B`` prompts, ``G`` samples per prompt, ``N = B*G`` rows,
``P`` prompt length, ``T`` response length):

========================  ===========  =======================================================
field                     shape        meaning
========================  ===========  =======================================================
``prompt_ids``            list[int]    non-tensor, one token list per row (prompt stage)
``prompts``               [N, P]       prompt token ids, left-padded with ``pad_token_id``
``responses``             [N, T]       response token ids, right-padded
``response_mask``         [N, T]       1 for generated tokens (EOS included), 0 for padding
``input_ids``             [N, P+T]     ``cat(prompts, responses)``
``attention_mask``        [N, P+T]     1 for real tokens in ``input_ids``
``position_ids``          [N, P+T]     ``cumsum(attention_mask) - 1``, clamped at 0
``rollout_log_probs``     [N, T]       per-token log-probs reported by the engine
``policy_version``        [N]          version (trained steps) of the weights that generated the row
``routed_experts``        [N,P+T,L,K]  int16: a MoE policy's expert per token, decoder layer and routing
                                       slot as the engine routed it (-1: none; :mod:`rltrainer.models.moe`)
``prompt_position``       [N, 3]       (epoch, loader batch, row) of the row's prompt
``old_log_probs``         [N, T]       log-probs of the policy before the update
``rollout_is_weights``    [N, T]       off-policy IS weights (detached, 0 on padding), if corrected
``ref_log_probs``         [N, T]       log-probs of the frozen reference model
``values``                [N, T]       critic values (PPO)
``scores``                [N]          total reward per sequence
``reward_components``     [N, F]       each reward function's unweighted score (names: the field below)
``reward_invalid``        [N]          bool, a reward function scored the row NaN/inf (GRPO)
``advantages``            [N, T]       per-token advantages (0 on padding)
``returns``               [N, T]       value targets (PPO)
``uid``                   str          non-tensor group id: rows with one prompt share it
``response_text``         str          non-tensor decoded response
========================  ===========  =======================================================
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # imported where a batch is built: it imports torch._dynamo (seconds), which --help does not need
    from tensordict import TensorDict

Index = int | slice | Sequence[int] | torch.Tensor | np.ndarray


def _object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array, even when the values are themselves lists of equal length."""
    out = np.empty(len(values), dtype=object)
    out[:] = list(values) if not isinstance(values, np.ndarray) else values
    return out


#: The typed batch-level fields of a :class:`RolloutBatch` (the module docstring lists them).
BATCH_FIELDS = ("padding_free", "padding", "global_tokens", "global_rows", "temperature", "rollout_metrics",
                "env_metrics", "logged", "reward_components", "loss_extras", "correct_in_update")


class RolloutBatch:
    """``N`` rows of named tensor and non-tensor fields, plus typed batch-level fields
    (:data:`BATCH_FIELDS`) and a free ``meta`` dict (see the module docstring)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | TensorDict | None = None,
        non_tensors: Mapping[str, Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
        padding_free: bool = False,
        *,
        padding: bool = False,
        global_tokens: float | None = None,
        global_rows: float | None = None,
        temperature: float | None = None,
        rollout_metrics: Mapping[str, float] | None = None,
        env_metrics: Mapping[str, float] | None = None,
        logged: Mapping[str, float] | None = None,
        reward_components: Sequence[str] = (),
        loss_extras: Sequence[str] = (),
        correct_in_update: bool = False,
    ) -> None:
        tensors = dict(tensors.items()) if tensors is not None else {}
        non_tensors = {k: _object_array(v) for k, v in (non_tensors or {}).items()}
        sizes = {k: int(v.shape[0]) for k, v in tensors.items()} | {k: len(v) for k, v in non_tensors.items()}
        if batch_size is None:
            batch_size = next(iter(sizes.values()), 0)
        wrong = {k: n for k, n in sizes.items() if n != batch_size}
        if wrong:
            raise ValueError(f"All fields of a RolloutBatch need {batch_size} rows; these differ: {wrong}")
        from tensordict import TensorDict

        self.tensors = TensorDict(tensors, batch_size=[batch_size])
        self.non_tensors: dict[str, np.ndarray] = non_tensors
        self.meta: dict[str, Any] = dict(meta or {})
        self.padding_free = padding_free  # rows run packed (set by the Strategy's form_micro_batches)
        self.padding = padding  # a padding micro-batch: its loss counts 0
        self.global_tokens = global_tokens  # response tokens of the mini-batch (the loss's normaliser)
        self.global_rows = global_rows  # rows of the mini-batch
        self.temperature = temperature  # the sampling temperature of the rows (None: 1.0)
        self.rollout_metrics: dict[str, float] = dict(rollout_metrics or {})  # the engine's rollout/* figures
        self.env_metrics: dict[str, float] = dict(env_metrics or {})  # an environment's env/* figures
        self.logged: dict[str, float] = dict(logged or {})  # step metrics the rows carry (the pipeline's)
        self.reward_components: list[str] = list(reward_components)  # names of reward_components [N, F]
        self.loss_extras: list[str] = list(loss_extras)  # fields the loss part's prepare added
        self.correct_in_update = correct_in_update  # the update recomputes the IS weights

    def fields(self) -> dict[str, Any]:
        """The typed batch-level fields, as the constructor's keyword arguments."""
        return {name: getattr(self, name) for name in BATCH_FIELDS}

    def _like(self, batch_size: int | None = None, meta: Mapping[str, Any] | None = None) -> RolloutBatch:
        """An empty batch with this one's batch-level fields and ``meta`` (copied)."""
        return RolloutBatch(meta=self.meta if meta is None else meta, batch_size=batch_size, **self.fields())

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> RolloutBatch:
        """Build a batch from dataset rows (a list of dicts); every value becomes a non-tensor field.

        Raises if the rows do not all have the same fields.
        """
        if isinstance(rows, Mapping):  # a dict of columns (e.g. a HF dataset slice)
            return cls(non_tensors=rows, meta=meta)
        keys = list(rows[0].keys()) if rows else []
        for i, row in enumerate(rows):
            if set(row.keys()) != set(keys):
                raise ValueError(f"Row {i} has fields {sorted(row)}, but row 0 has {sorted(keys)}.")
        return cls(non_tensors={k: [row[k] for row in rows] for k in keys}, meta=meta)

    @classmethod
    def from_loader(cls, raw: Any) -> RolloutBatch:
        """A dataloader's batch as a batch: a ``RolloutBatch`` as is, a list of dict rows, or a dict of columns."""
        if isinstance(raw, RolloutBatch):
            return raw
        if (isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], Mapping)) or isinstance(raw, Mapping):
            return cls.from_rows(raw)
        raise TypeError(
            "A dataloader batch must be a RolloutBatch, a list of dict rows, or a dict of columns; got "
            f"{type(raw).__name__}. Use rltrainer.data.prompt_dataloader(dataset, batch_size) to build one."
        )

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Concatenate batches along rows. ``meta`` and the batch-level fields are the first batch's."""
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        keys = set(batches[0].non_tensors)
        for b in batches[1:]:
            if set(b.non_tensors) != keys or set(b.tensors.keys()) != set(batches[0].tensors.keys()):
                raise ValueError("RolloutBatch.concat needs batches with the same fields")
        tensors = torch.cat([b.tensors for b in batches]) if batches[0].tensors.keys() else None
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in keys}
        out = cls(non_tensors=non_tensors, meta=batches[0].meta, batch_size=sum(len(b) for b in batches),
                  **batches[0].fields())
        if tensors is not None:
            out.tensors = tensors
        return out

    # -- access --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def __contains__(self, key: str) -> bool:
        return key in self.tensors.keys() or key in self.non_tensors

    def keys(self) -> list[str]:
        return list(self.tensors.keys()) + list(self.non_tensors)

    def __getitem__(self, index: str | Index) -> Any:
        if isinstance(index, str):
            if index in self.non_tensors:
                return self.non_tensors[index]
            if index in self.tensors.keys():
                return self.tensors[index]
            raise KeyError(f"RolloutBatch has no field {index!r}; fields: {self.keys()}")
        if isinstance(index, int):
            index = slice(index, index + 1) if index != -1 else slice(-1, None)
        np_index = index.cpu().numpy() if isinstance(index, torch.Tensor) else index
        if isinstance(np_index, (list, tuple)):
            np_index = np.asarray(np_index, dtype=np.int64)
        out = self._like()
        out.tensors = self.tensors[index if not isinstance(index, (list, tuple)) else torch.as_tensor(index)]
        if out.tensors is self.tensors:  # tensordict returns itself for [:]; fields set on the copy stay there
            out.tensors = self.tensors.copy()
        out.non_tensors = {k: v[np_index] for k, v in self.non_tensors.items()}
        return out

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.shape[0] != len(self):
                raise ValueError(f"Field {key!r} has {value.shape[0]} rows; the batch has {len(self)}")
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            if len(value) != len(self):
                raise ValueError(f"Field {key!r} has {len(value)} rows; the batch has {len(self)}")
            if key in self.tensors.keys():
                del self.tensors[key]
            self.non_tensors[key] = _object_array(value)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    # -- transforms (all return new batches; tensors are shared, not copied, where possible) ----
    def select(self, *keys: str, strict: bool = True) -> RolloutBatch:
        """A batch with only ``keys`` (tensor or non-tensor); ``meta`` is kept."""
        missing = [k for k in keys if k not in self]
        if missing and strict:
            raise KeyError(f"RolloutBatch has no fields {missing}; fields: {self.keys()}")
        out = self._like(len(self))
        out.tensors = self.tensors.select(*[k for k in keys if k in self.tensors.keys()])
        out.non_tensors = {k: v for k, v in self.non_tensors.items() if k in keys}
        return out

    def union(self, other: RolloutBatch) -> RolloutBatch:
        """This batch with ``other``'s fields added (``other`` wins on clashes); same row count."""
        if len(other) != len(self):
            raise ValueError(f"Cannot union a batch of {len(other)} rows into one of {len(self)}")
        out = self.copy()
        for k in other.tensors.keys():
            out.tensors[k] = other.tensors[k]
        out.non_tensors.update(other.non_tensors)
        out.meta.update(other.meta)
        for name, value in other.fields().items():  # other's wins where it is set
            if value is not None and value is not False and not (isinstance(value, (list, dict)) and not value):
                setattr(out, name, value)
        return out

    def copy(self) -> RolloutBatch:
        """A shallow copy: new containers, shared tensors."""
        out = self._like(len(self))
        out.tensors = self.tensors.clone(recurse=False)
        out.non_tensors = dict(self.non_tensors)
        return out

    def repeat(self, repeats: int, interleave: bool = True) -> RolloutBatch:
        """Repeat every row ``repeats`` times: ``interleave`` gives ``a a b b``, else ``a b a b``."""
        n = len(self)
        index = np.repeat(np.arange(n), repeats) if interleave else np.tile(np.arange(n), repeats)
        return self[torch.from_numpy(index)]

    def chunk(self, chunks: int) -> list[RolloutBatch]:
        """Split into ``chunks`` parts of near-equal size (the last ones may be smaller)."""
        if chunks <= 0:
            raise ValueError(f"chunks must be positive, got {chunks}")
        size = -(-len(self) // chunks)
        return self.split(size) if len(self) else [self]

    def split(self, size: int) -> list[RolloutBatch]:
        """Consecutive parts of ``size`` rows (the last may be smaller)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self[i : i + size] for i in range(0, len(self), size)]

    def split_by_tokens(self, max_tokens: int, mask_key: str = "attention_mask",
                        packed: bool = False) -> list[RolloutBatch]:
        """Consecutive parts whose padded token count (rows x longest row) stays within ``max_tokens``;
        with ``packed``, whose real token count (the sum of the rows' lengths: a packed forward's
        sequence, :mod:`rltrainer.packing`) does.

        A row longer than ``max_tokens`` gets a part of its own.
        """
        lengths = self.tensors[mask_key].sum(-1).tolist()
        parts, start, longest, total = [], 0, 0, 0
        for i, length in enumerate(lengths):
            new_longest, new_total = max(longest, int(length)), total + int(length)
            cost = new_total if packed else new_longest * (i - start + 1)
            if i > start and cost > max_tokens:
                parts.append(self[start:i])
                start, new_longest, new_total = i, int(length), int(length)
            longest, total = new_longest, new_total
        parts.append(self[start:])
        return parts

    def to(self, device: torch.device | str) -> RolloutBatch:
        out = self.copy()
        out.tensors = self.tensors.to(device)
        return out

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in self.tensors.items())
        return (f"RolloutBatch(rows={len(self)}, tensors={{{tensors}}}, non_tensors={list(self.non_tensors)}, "
                f"meta={list(self.meta)})")

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("Iterate over rows with batch.split(1), or over fields with batch.keys()")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle tensors as numpy arrays: Ray moves those through its shared-memory object store
        without copying them into the pickle stream (dtypes numpy lacks, e.g. bf16, stay tensors)."""
        arrays = {k: _to_numpy(v) for k, v in self.tensors.items()}
        return _rebuild_batch, (arrays, self.non_tensors, self.meta, len(self), self.fields())


def concat_rollouts(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Rows of several requests as one batch: prompt-side fields (``[n, P]``, and the prompt part of
    ``[n, P+T]``) left-padded to the widest ``P``, response-side ones (``[n, T]``) right-padded."""
    if len(batches) == 1:
        return batches[0]
    P = max(b["prompts"].shape[1] for b in batches)
    T = max(b["responses"].shape[1] for b in batches)
    pad_values = {"prompts": pad_token_id, "responses": pad_token_id, "input_ids": pad_token_id, "routed_experts": -1}
    out = []
    for b in batches:
        b = b.copy()
        p, t = b["prompts"].shape[1], b["responses"].shape[1]
        for key in list(b.tensors.keys()):
            x, value = b[key], pad_values.get(key, 0)
            if x.dim() < 2 or key == "prompt_position":
                continue
            if p and x.shape[1] == p + t:
                left = torch.nn.functional.pad(x[:, :p], (P - p, 0), value=value)
                b[key] = torch.cat([left, torch.nn.functional.pad(x[:, p:], (0, T - t), value=value)], dim=1)
            elif x.shape[1] == p and key == "prompts":
                b[key] = torch.nn.functional.pad(x, (P - p, 0), value=value)
            elif x.shape[1] == t:
                b[key] = torch.nn.functional.pad(x, (0, T - t), value=value)
        out.append(b)
    return RolloutBatch.concat(out)


def routes_as_rows(routes: list[torch.Tensor], prompt_lengths: list[int], P: int, T: int) -> torch.Tensor:
    """An engine's routes (:attr:`~rltrainer.rollout.engine.Generation.routed_experts`: per row
    ``[p + t, L, K]``) as ``[N, P+T, L, K]`` int16, aligned with ``input_ids``: the prompt's tokens
    end at column ``P``, the response's start there; -1 elsewhere."""
    L, K = routes[0].shape[1:] if routes else (0, 0)
    out = torch.full((len(routes), P + T, L, K), -1, dtype=torch.int16)
    for i, (r, p) in enumerate(zip(routes, prompt_lengths)):
        r = r[: p + T]
        out[i, P - p : P - p + len(r)] = r.to(torch.int16)
    return out


def _to_numpy(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    t = t.detach().cpu()
    return t.numpy() if t.dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2) else t


def _rebuild_batch(arrays: dict[str, Any], non_tensors: dict[str, np.ndarray], meta: dict[str, Any],
                   rows: int, fields: dict[str, Any]) -> RolloutBatch:
    tensors = {}
    for k, a in arrays.items():
        if isinstance(a, np.ndarray):  # zero-copy arrays from Ray's store are read-only: copy those once
            a = a if a.flags.writeable else a.copy()
            tensors[k] = torch.from_numpy(a)
        else:
            tensors[k] = a
    out = RolloutBatch(tensors, batch_size=rows, meta=meta, **fields)
    out.non_tensors = dict(non_tensors)
    return out

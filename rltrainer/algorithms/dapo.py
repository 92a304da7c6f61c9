"""DAPO's batch-level pieces (Yu et al. 2025, arXiv:2503.14476), as pure functions the
:class:`~rltrainer.DAPO` hooks call: the soft overlong penalty (section 3.4) and the groups that
dynamic sampling keeps (section 3.2)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rltrainer.algorithms.advantages import group_index


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment ``[N]`` for response lengths ``[N]`` (tokens): 0 up to
    ``L_max - L_cache``, then falling linearly to ``-factor`` at ``L_max``::

        -factor * min(1, max(0, L - (L_max - L_cache)) / L_cache)

    verl's ``DAPORewardManager`` (verl/workers/reward_manager/dapo.py:117-121 at b178a3c):
    ``min(-(L - (max_resp_len - len)) / len * penalty_factor, 0)``, the same for ``L <= L_max`` (a
    response cannot be longer); the ``min(1, .)`` keeps it at ``-factor`` beyond.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"Need 0 < buffer_length <= max_length (L_cache within L_max), got buffer_length="
                         f"{buffer_length}, max_length={max_length}")
    exceed = (lengths.float() - (max_length - buffer_length)).clamp(min=0)  # [N]
    return -factor * (exceed / buffer_length).clamp(max=1.0)


def mixed_groups(scores: torch.Tensor, uids: Sequence[object]) -> list[list[int]]:
    """The rows of each group whose ``scores [N]`` are not all equal, groups in order of first
    appearance (dynamic sampling keeps these; a group of equal scores has zero advantage)."""
    groups = group_index(uids)  # [N]
    rows: dict[int, list[int]] = {}
    for row, group in enumerate(groups.tolist()):
        rows.setdefault(group, []).append(row)
    return [members for members in rows.values() if scores[members].max() > scores[members].min()]

"""The built-in modules' optimizer: AdamW, fused where torch has a fused kernel for the parameters.

``torch.optim.AdamW`` defaults to its per-tensor loop on CPU, which allocates two
parameter-sized temporaries per tensor and step (``sqrt(v)``, and it divided by the bias
correction): at Qwen2.5's 151,665-entry vocabulary with hidden 256 the embedding's are 0.3 GB and
its step takes 1.0 s on one CPU thread. The fused kernel updates in place: 0.10 s and 0.15 GB
less peak memory on that tensor (``tests/benchmarks/README.md``), with results equal to the loop's
within an ulp. HF's Trainer (and so TRL) defaults to ``adamw_torch_fused`` too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

FUSED_DEVICES = ("cpu", "cuda")


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether AdamW's fused kernel takes these parameters: plain (not DTensor) floating tensors,
    all on one CPU or CUDA device."""
    if not params:
        return False
    from torch.distributed.tensor import DTensor

    devices = {p.device for p in params}
    return (len(devices) == 1 and next(iter(devices)).type in FUSED_DEVICES
            and all(p.is_floating_point() and not isinstance(p, DTensor) for p in params))


def adamw(params: Iterable[torch.Tensor], lr: float, weight_decay: float = 0.0, **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, lr, weight_decay=...)``, with ``fused=True`` where
    :func:`fused_supported` (an explicit ``fused`` or ``foreach`` in ``kwargs`` wins)."""
    params = list(params)
    if "fused" not in kwargs and "foreach" not in kwargs and fused_supported(params):
        kwargs["fused"] = True
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kwargs)

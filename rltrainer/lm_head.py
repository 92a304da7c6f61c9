"""Selected-token log-probs and entropy straight from hidden states and the LM head, in chunks.

A 151,665-token vocabulary makes the logits of one micro-batch (8 rows x 560 tokens) 2.7 GB in
fp32; the log-softmax, the entropy and their gradients over them are most of a small model's
update. :func:`chunked_log_probs` never holds ``[rows, T, V]``: it multiplies ``chunk`` tokens'
hidden states by the head at a time, keeps per token only the log-normaliser and the entropy, and
its backward recomputes each chunk's logits (the fused-linear-cross-entropy idea, in plain torch,
so it runs on any device). With ``group`` the head is split by vocabulary rows over the ranks of a
tensor-parallel group (megatron's vocabulary-parallel output layer): each rank computes its own
columns and the per-token maxima and sums are all-reduced.

Math, per token with ``z = (h @ W.T) / temperature`` (in fp32), ``lse = logsumexp(z)``,
``log p = z - lse``, entropy ``H = lse - sum(p * z)``::

    d log p[y] / dz = onehot(y) - p
    dH / dz         = -p * (log p + H)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

CHUNK_ELEMENTS = {"cpu": 2**23, "cuda": 2**26}
"""Default chunk, by device: ``CHUNK_ELEMENTS[device] // vocabulary`` tokens. On CPU a chunk's
fp32 logits are 32 MiB (55 tokens at 151,665 entries, 2,048 at 4,096): glibc serves blocks up to
its largest mmap threshold (32 MiB on 64-bit) from heaps it reuses, where each larger block is
mapped, faulted in page by page and unmapped again (the CPU preset's system time). On CUDA, 256 MiB
(the caching allocator reuses blocks; larger products run closer to peak)."""


def chunk_tokens_for(vocab: int, chunk_tokens: int | None = None, device: str = "cpu") -> int:
    """Tokens per chunk: ``chunk_tokens`` if given, else :data:`CHUNK_ELEMENTS` ``[device] // vocab``
    (at least 16)."""
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens}: give a positive number of tokens per chunk, or None "
                             f"for the default (CHUNK_ELEMENTS[device] // vocabulary size)")
        return chunk_tokens
    return max(16, CHUNK_ELEMENTS.get(device, CHUNK_ELEMENTS["cuda"]) // max(vocab, 1))


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                      chunk_tokens: int | None = None, group: Any = None, vocab_start: int = 0,
                      vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax(h @ W.T / temperature)[targets], entropy)``, both ``[N]`` float32, from
    ``hidden [N, H]``, ``weight [V_local, H]`` and ``targets [N]`` (indices into the whole
    vocabulary), without materialising ``[N, V]``; differentiable in ``hidden`` and ``weight``.

    With a tensor-parallel ``group``, ``weight`` holds the rows ``vocab_start ...`` of the head
    (this rank's slice; gradients of ``hidden`` are this rank's part, to be summed over the group
    as megatron's ``copy_to_tensor_model_parallel_region`` does). ``vocab_size`` (the real
    vocabulary) drops padded rows past it."""
    if hidden.dim() != 2 or weight.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"chunked_log_probs takes hidden [N, H], weight [V, H] and targets [N]; got "
                         f"{list(hidden.shape)}, {list(weight.shape)} and {list(targets.shape)}")
    rows = weight.shape[0] if vocab_size is None else max(0, min(weight.shape[0], vocab_size - vocab_start))
    vocab = weight.shape[0] if group is None else weight.shape[0] * _world(group)
    chunk = chunk_tokens_for(vocab, chunk_tokens, hidden.device.type)
    options = _Options(float(temperature), chunk, group, vocab_start, rows)
    return _ChunkedHead.apply(hidden, weight, targets, options)


@dataclasses.dataclass(frozen=True)
class _Options:
    temperature: float
    chunk: int  # tokens per chunk
    group: Any  # tensor-parallel process group, or None
    vocab_start: int  # this rank's first vocabulary row
    rows: int  # this rank's rows inside the real vocabulary (padding past it dropped)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                options: _Options) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(lse)
        log_probs = torch.empty_like(lse)
        for start in range(0, n, options.chunk):
            stop = min(n, start + options.chunk)
            z = _logits(hidden[start:stop], weight, options)  # [c, V_local] fp32
            stats = _forward_stats(z, targets[start:stop], options)
            lse[start:stop], entropy[start:stop], log_probs[start:stop] = stats
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.options = options
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        options: _Options = ctx.options
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        accumulate = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], options.chunk):
            stop = min(hidden.shape[0], start + options.chunk)
            h = hidden[start:stop]
            z = _logits(h, weight, options)
            g = _grad_logits(z, targets[start:stop], lse[start:stop], entropy[start:stop],
                             None if grad_log_probs is None else grad_log_probs[start:stop],
                             None if grad_entropy is None else grad_entropy[start:stop], options)
            g = g.to(weight.dtype)  # [c, V_local]: gradient of the head's output (before the fp32 cast)
            if grad_hidden is not None:
                torch.mm(g, weight[: options.rows], out=grad_hidden[start:stop])
            if grad_weight is not None:
                grad_weight[: options.rows].addmm_(g.t().to(accumulate), h.to(accumulate))
        if grad_weight is not None and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def _logits(h: torch.Tensor, weight: torch.Tensor, options: _Options) -> torch.Tensor:
    """``(h @ W[:rows].T).float() / temperature``: ``[c, rows]`` fp32, computed in the head's dtype."""
    z = torch.mm(h, weight[: options.rows].t()).float()
    if options.temperature != 1.0:
        z.div_(options.temperature)
    return z


def _forward_stats(z: torch.Tensor, targets: torch.Tensor, options: _Options
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lse, entropy, log_probs)`` of one chunk's logits ``z [c, V_local]`` (all-reduced over
    the group); ``z`` is overwritten."""
    local = targets - options.vocab_start
    here = (local >= 0) & (local < z.shape[1])
    if z.shape[1]:
        target_z = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1).masked_fill(~here, 0.0)
        top = z.amax(1)
    else:  # every row of this rank's slice is padding
        target_z, top = z.new_zeros(z.shape[0]), z.new_full((z.shape[0],), -torch.inf)
    _all_reduce(top, options.group, max_=True)
    z.sub_(top[:, None])  # z - max
    p = z.exp()
    weighted = torch.bmm(p[:, None, :], z[:, :, None]).view(-1)  # sum(p * z) without a [c, V] temporary
    sums = torch.stack([p.sum(1), weighted, target_z], 1)  # [c, 3]
    _all_reduce(sums, options.group)
    total, weighted, target_z = sums.unbind(1)
    log_total = total.log()
    lse = top + log_total
    entropy = log_total - weighted / total  # lse - E_p[z], both taken from max
    return lse, entropy, target_z - lse


def _grad_logits(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                 options: _Options) -> torch.Tensor:
    """Gradient of the loss w.r.t. the head's output for one chunk, from its recomputed logits
    ``z [c, V_local]`` (overwritten): ``-p * (g_lp + g_H * (log p + H)) + g_lp * onehot(y)``,
    divided by the temperature."""
    log_p = z.sub_(lse[:, None])
    p = log_p.exp()
    if grad_entropy is not None:
        coef = log_p.add_(entropy[:, None]).mul_(grad_entropy[:, None])
        if grad_log_probs is not None:
            coef.add_(grad_log_probs[:, None])
        g = coef.mul_(p).neg_()
    elif grad_log_probs is not None:
        g = p.mul_(grad_log_probs[:, None]).neg_()
    else:
        g = p.zero_()
    if grad_log_probs is not None:
        local = targets - options.vocab_start
        here = (local >= 0) & (local < g.shape[1])
        rows = torch.nonzero(here).squeeze(1)
        g.index_put_((rows, local[rows]), grad_log_probs[rows], accumulate=True)
    if options.temperature != 1.0:
        g.div_(options.temperature)
    return g


def _all_reduce(tensor: torch.Tensor, group: Any, max_: bool = False) -> None:
    if group is None:
        return
    import torch.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if max_ else dist.ReduceOp.SUM, group=group)


def _world(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)

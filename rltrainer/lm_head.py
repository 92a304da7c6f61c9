"""Selected-token log-probs and entropy straight from hidden states and the LM head, in chunks.

A 151,665-token vocabulary makes the logits of one micro-batch (8 rows x 560 tokens) 2.7 GB in
fp32; the log-softmax, the entropy and their gradients over them are most of a small model's
update. :func:`chunked_log_probs` never holds ``[rows, T, V]``: it multiplies ``chunk`` tokens'
hidden states by the head at a time, keeps per token only the log-normaliser and the entropy, and
its backward recomputes each chunk's logits (the fused-linear-cross-entropy idea, in plain torch,
so it runs on any device). On CPU each chunk goes over the vocabulary in cache-sized blocks,
combined as in online softmax (:data:`CHUNK_ELEMENTS`). With ``group`` the head is split by vocabulary rows over the ranks of a
tensor-parallel group (megatron's vocabulary-parallel output layer): each rank computes its own
columns and the per-token maxima and sums are all-reduced.

Math, per token with ``z = (h @ W.T) / temperature`` (in fp32), ``lse = logsumexp(z)``,
``log p = z - lse``, entropy ``H = lse - sum(p * z)``::

    d log p[y] / dz = onehot(y) - p
    dH / dz         = -p * (log p + H)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

_INTO_GRAD: ContextVar[bool] = ContextVar("rltrainer_grad_into_parameters", default=False)

CHUNK_ELEMENTS = {"cpu": 2**18, "cuda": 2**26}
"""Logits held at once, by device. On CUDA, a chunk of ``CHUNK_ELEMENTS["cuda"] // vocabulary``
tokens over the whole vocabulary (256 MiB of fp32; the caching allocator reuses the blocks, and
larger products run closer to peak). On CPU, a chunk of :data:`CPU_CHUNK_TOKENS` tokens is taken
in blocks of ``CHUNK_ELEMENTS["cpu"] // tokens`` vocabulary rows (1 MiB of fp32 logits, 512
rows for 512 tokens): each block's product, softmax statistics and gradients run while it is in
the core's L2 cache, where a product over the whole vocabulary writes its logits to memory and
reads them back. At Qwen2.5's 151,665 entries that makes the forward about 2x and the backward
about 1.4x faster on one core (``tests/benchmarks/README.md``), and no buffer of the head's is
larger than a block."""

CPU_CHUNK_TOKENS = 512
"""Tokens per chunk on CPU (the rows of each block's product)."""


@contextlib.contextmanager
def gradients_into_parameters() -> Iterator[None]:
    """Inside it, the vocabulary-sized weights' gradients go straight into ``weight.grad``.

    The chunked head (:func:`chunked_log_probs`) and :func:`embedding_into_grad`'s lookup add their
    gradient to the parameter's ``.grad`` during the backward (Megatron's gradient-accumulation
    fusion) instead of returning a ``[V, H]`` tensor that autograd then adds there. With tied
    embeddings that is two ``[V, H]`` buffers (and a pass over each) less per micro-batch: 0.29 GB
    at Qwen2.5's 151,665 x 256. Only for what was called inside it (the decision is taken at the
    forward), for an ``nn.Parameter`` leaf in fp32/fp64 that is not a DTensor; the caller must
    back-propagate with ``loss.backward()`` (``torch.autograd.grad`` would not see those
    gradients), as the strategies' shared training step does."""
    token = _INTO_GRAD.set(True)
    try:
        yield
    finally:
        _INTO_GRAD.reset(token)


def _into_grad(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s gradient may be added to its ``.grad`` in place (see
    :func:`gradients_into_parameters`)."""
    if not (_INTO_GRAD.get() and torch.is_grad_enabled() and isinstance(weight, torch.nn.Parameter)):
        return False
    if not (weight.is_leaf and weight.requires_grad) or weight.dtype not in (torch.float32, torch.float64):
        return False
    if type(weight.data) is not torch.Tensor:  # a DTensor (FSDP2's sharded parameter), a tensor subclass
        return False
    grad = weight.grad
    return grad is None or (grad.layout == torch.strided and grad.dtype == weight.dtype and grad.shape == weight.shape)


def _grad_buffer(weight: torch.Tensor) -> torch.Tensor:
    """``weight.grad``, made (zeros) if it is ``None``."""
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    return weight.grad


@contextlib.contextmanager
def embedding_into_grad(model: torch.nn.Module) -> Iterator[None]:
    """Inside it (and :func:`gradients_into_parameters`), ``model``'s input embedding (a plain
    ``nn.Embedding``: no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``) adds its gradient rows
    into ``weight.grad`` in its backward (``index_add_`` of the looked-up rows, none for
    ``padding_idx``), instead of making the dense ``[V, H]`` gradient ``F.embedding``'s backward
    makes. Any other model runs as it is."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    plain = (type(embedding) is torch.nn.Embedding and embedding.max_norm is None
             and not embedding.scale_grad_by_freq and not embedding.sparse)
    if not plain or not _into_grad(embedding.weight):
        yield
        return
    padding_idx = embedding.padding_idx

    def forward(ids: torch.Tensor) -> torch.Tensor:
        if not _into_grad(embedding.weight):  # e.g. a forward under no_grad inside the context
            return torch.nn.functional.embedding(ids, embedding.weight, padding_idx)
        return _EmbeddingIntoGrad.apply(ids, embedding.weight, padding_idx)

    with head_forward(embedding, forward):
        yield


class _EmbeddingIntoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        ids, rows = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:
            keep = ids != ctx.padding_idx
            ids, rows = ids[keep], rows[keep]
        with torch.no_grad():
            _grad_buffer(ctx.weight).index_add_(0, ids, rows.to(ctx.weight.dtype))
        return None, None, None


def chunk_tokens_for(vocab: int, chunk_tokens: int | None = None, device: str = "cpu") -> int:
    """Tokens per chunk: ``chunk_tokens`` if given, else :data:`CPU_CHUNK_TOKENS` on CPU and
    ``CHUNK_ELEMENTS[device] // vocab`` (at least 16) elsewhere."""
    if chunk_tokens is not None:
        return _positive("chunk_tokens", chunk_tokens, "tokens per chunk")
    if device == "cpu":
        return CPU_CHUNK_TOKENS
    return max(16, CHUNK_ELEMENTS.get(device, CHUNK_ELEMENTS["cuda"]) // max(vocab, 1))


def _positive(name: str, value: int, what: str) -> int:
    """``value``, or a ValueError naming ``name`` if it is below 1."""
    if value < 1:
        raise ValueError(f"{name}={value}: give a positive number of {what}, or None for the default")
    return value


def vocab_block_for(rows: int, chunk: int, vocab_block: int | None = None, device: str = "cpu") -> int:
    """Vocabulary rows per block of a ``chunk``-token chunk: ``vocab_block`` if given, else
    ``CHUNK_ELEMENTS["cpu"] // chunk`` on CPU (at least 128) and all ``rows`` elsewhere."""
    if vocab_block is not None:
        return _positive("vocab_block", vocab_block, "vocabulary rows per block")
    if device == "cpu":
        return max(128, CHUNK_ELEMENTS["cpu"] // chunk)
    return max(rows, 1)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``hidden [b, H] @ weight[V, H].T`` written into ``out [b, V]`` (same dtype), in the blocks of
    vocabulary rows :func:`chunked_log_probs` takes on CPU (about 1.5x faster there than one
    product over the whole vocabulary at 151,665 entries; one product elsewhere)."""
    if hidden.device.type != "cpu":
        return torch.mm(hidden, weight.t(), out=out)
    block = vocab_block_for(weight.shape[0], CPU_CHUNK_TOKENS)
    for first in range(0, weight.shape[0], block):
        torch.mm(hidden, weight[first : first + block].t(), out=out[:, first : first + block])
    return out


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                      chunk_tokens: int | None = None, group: Any = None, vocab_start: int = 0,
                      vocab_size: int | None = None, vocab_block: int | None = None, scale: float = 1.0,
                      softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax(h @ W.T / temperature)[targets], entropy)``, both ``[N]`` float32, from
    ``hidden [N, H]``, ``weight [V_local, H]`` and ``targets [N]`` (indices into the whole
    vocabulary), without materialising ``[N, V]``; differentiable in ``hidden`` and ``weight``.

    The tokens go ``chunk_tokens`` at a time (:func:`chunk_tokens_for`), each chunk over the
    vocabulary in blocks of ``vocab_block`` rows (:func:`vocab_block_for`; the softmax statistics
    are combined over the blocks as in online softmax). With a tensor-parallel ``group``,
    ``weight`` holds the rows ``vocab_start ...`` of the head (this rank's slice; gradients of
    ``hidden`` are this rank's part, to be summed over the group as megatron's
    ``copy_to_tensor_model_parallel_region`` does). ``vocab_size`` (the real vocabulary) drops
    padded rows past it. A model that scales or soft-caps its head's output before returning it
    (:class:`~rltrainer.models.support.HeadOutput`) gives ``scale`` and ``softcap``: the logits are
    then ``softcap * tanh(h @ W.T * scale / softcap)`` (in fp32), before the temperature."""
    if hidden.dim() != 2 or weight.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"chunked_log_probs takes hidden [N, H], weight [V, H] and targets [N]; got "
                         f"{list(hidden.shape)}, {list(weight.shape)} and {list(targets.shape)}")
    rows = weight.shape[0] if vocab_size is None else max(0, min(weight.shape[0], vocab_size - vocab_start))
    vocab = weight.shape[0] if group is None else weight.shape[0] * _world(group)
    device = hidden.device.type
    chunk = chunk_tokens_for(vocab, chunk_tokens, device)
    block = vocab_block_for(rows, chunk, vocab_block, device)
    options = _Options(float(temperature), chunk, group, vocab_start, rows, block,
                       group is None and _into_grad(weight), float(scale), None if softcap is None else float(softcap))
    return _ChunkedHead.apply(hidden, weight, targets, options)


@dataclasses.dataclass(frozen=True)
class _Options:
    temperature: float
    chunk: int  # tokens per chunk
    group: Any  # tensor-parallel process group, or None
    vocab_start: int  # this rank's first vocabulary row
    rows: int  # this rank's rows inside the real vocabulary (padding past it dropped)
    block: int  # vocabulary rows per block
    into_grad: bool = False  # add the weight's gradient to weight.grad (gradients_into_parameters)
    scale: float = 1.0  # the model's factor on its head's output (Granite: 1 / logits_scaling)
    softcap: float | None = None  # the model's final soft-cap (Gemma 2: final_logit_softcapping)

    def blocks(self) -> range:
        """First rows of this rank's blocks."""
        return range(0, self.rows, self.block)


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
            stats = _chunk_stats(hidden[start:stop], weight, targets[start:stop], options)
            lse[start:stop], entropy[start:stop], log_probs[start:stop] = stats
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.options = options
        ctx.weight = weight if options.into_grad else None  # the parameter itself, whose .grad takes the gradient
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        options: _Options = ctx.options
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        accumulate = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        grad_weight = None
        if want_weight and options.into_grad:
            grad_weight = _grad_buffer(ctx.weight)  # added in place; autograd gets None for the weight
        elif want_weight:
            grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        for start in range(0, hidden.shape[0], options.chunk):
            stop = min(hidden.shape[0], start + options.chunk)
            h = hidden[start:stop]
            h_acc = h.to(accumulate)
            for first in options.blocks():
                w = weight[first : min(options.rows, first + options.block)]
                z = _logits(h, w, options)
                slope = _cap_slope(z, options)  # d logits / d (h @ W.T), before z is overwritten
                g = _grad_logits(z, targets[start:stop], lse[start:stop], entropy[start:stop],
                                 None if grad_log_probs is None else grad_log_probs[start:stop],
                                 None if grad_entropy is None else grad_entropy[start:stop],
                                 options.vocab_start + first, options.temperature)
                if slope is not None:
                    g.mul_(slope)
                g = g.to(weight.dtype)  # [c, b]: gradient of the head's output (before the fp32 cast)
                if grad_hidden is not None:
                    grad_hidden[start:stop].addmm_(g, w)
                if grad_weight is not None:
                    grad_weight[first : first + w.shape[0]].addmm_(g.t().to(accumulate), h_acc)
        if options.into_grad:
            return grad_hidden, None, None, None
        if grad_weight is not None and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def _logits(h: torch.Tensor, w: torch.Tensor, options: _Options) -> torch.Tensor:
    """``(h @ w.T).float() / temperature``: ``[c, b]`` fp32 for a block ``w`` of the head's rows,
    computed in the head's dtype (scaled and soft-capped first, as the model does)."""
    z = torch.mm(h, w.t()).float()
    if options.scale != 1.0:
        z.mul_(options.scale)
    if options.softcap is not None:
        z.div_(options.softcap).tanh_().mul_(options.softcap)
    if options.temperature != 1.0:
        z.div_(options.temperature)
    return z


def _cap_slope(z: torch.Tensor, options: _Options) -> torch.Tensor | float | None:
    """The derivative of the model's logits by ``h @ W.T`` at a block's logits ``z`` (as
    :func:`_logits` returns them): ``scale * (1 - tanh^2)`` with a soft-cap, ``scale`` without one,
    ``None`` for 1."""
    if options.softcap is None:
        return options.scale if options.scale != 1.0 else None
    tanh = z * (options.temperature / options.softcap)
    return tanh.square_().neg_().add_(1.0).mul_(options.scale)


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, options: _Options
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lse, entropy, log_probs)`` of one chunk of tokens ``h [c, H]``, over the head's blocks
    and (all-reduced) the group's ranks.

    Per token it keeps the largest logit ``m`` seen so far, ``s0 = sum exp(z - m)`` and
    ``s1 = sum exp(z - m) * (z - m)`` over the logits seen, rescaled when ``m`` grows; then
    ``lse = m + log s0`` and the entropy ``lse - E_p[z] = log s0 - s1 / s0``."""
    c = h.shape[0]
    top = torch.full((c,), -torch.inf, dtype=torch.float32, device=h.device)
    s0, s1, target_z = (torch.zeros(c, dtype=torch.float32, device=h.device) for _ in range(3))
    for first in options.blocks():
        z = _logits(h, weight[first : min(options.rows, first + options.block)], options)  # [c, b]
        local = targets - (options.vocab_start + first)
        here = (local >= 0) & (local < z.shape[1])
        target_z += z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1).masked_fill_(~here, 0.0)
        new_top = torch.maximum(top, z.amax(1))
        s0, s1 = _rescale(s0, s1, top, new_top)
        top = new_top
        z.sub_(top[:, None])  # z - m
        p = z.exp()
        s0 += p.sum(1)
        s1 += torch.bmm(p[:, None, :], z[:, :, None]).view(-1)  # sum(p * (z - m)) without a [c, b] temporary
    if options.group is not None:
        overall = top.clone()
        _all_reduce(overall, options.group, max_=True)
        s0, s1 = _rescale(s0, s1, top, overall)
        top = overall
        sums = torch.stack([s0, s1, target_z], 1)  # [c, 3]
        _all_reduce(sums, options.group)
        s0, s1, target_z = sums.unbind(1)
    log_s0 = s0.log()
    lse = top + log_s0
    return lse, log_s0 - s1 / s0, target_z - lse


def _rescale(s0: torch.Tensor, s1: torch.Tensor, top: torch.Tensor, new_top: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s0`` and ``s1`` (taken from ``top``) taken from ``new_top >= top`` instead."""
    shift = torch.where(s0 > 0, top - new_top, 0.0)  # 0 where nothing was seen yet (top = -inf)
    scale = shift.exp()
    return s0 * scale, (s1 + s0 * shift) * scale


def _grad_logits(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                 first_row: int, temperature: float) -> torch.Tensor:
    """Gradient of the loss w.r.t. the head's output for one block, from its recomputed logits
    ``z [c, b]`` (overwritten; of vocabulary rows ``first_row ...``):
    ``-p * (g_lp + g_H * (log p + H)) + g_lp * onehot(y)``, divided by the temperature."""
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
        local = targets - first_row
        here = (local >= 0) & (local < g.shape[1])
        rows = torch.nonzero(here).squeeze(1)
        g.index_put_((rows, local[rows]), grad_log_probs[rows], accumulate=True)
    if temperature != 1.0:
        g.div_(temperature)
    return g


def _all_reduce(tensor: torch.Tensor, group: Any, max_: bool = False) -> None:
    if group is None:
        return
    import torch.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if max_ else dist.ReduceOp.SUM, group=group)


def _world(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


@contextlib.contextmanager
def head_forward(head: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Inside it, ``head(x)`` is ``forward(x)`` (an instance attribute over the class's forward;
    the previous one is restored after)."""
    previous = head.__dict__.get("forward")
    head.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous

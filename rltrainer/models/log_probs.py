"""The teacher-forced forward over response tokens: per-token log-probs and entropies of a
batch's responses under a causal LM (:func:`response_log_probs`), padded or packed
(:mod:`rltrainer.packing`), with the LM head in chunks (:mod:`rltrainer.lm_head`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from rltrainer.data.batch import RolloutBatch
from rltrainer.lm_head import chunked_log_probs, embedding_into_grad, head_forward
from rltrainer.models.moe import replaying
from rltrainer.models.support import HeadOutput, chunkable_head
from rltrainer.packing import packed_rows_for


def response_log_probs(
    model: torch.nn.Module,
    batch: RolloutBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int | None = None,
    padding_free: bool | None = None,
    routed_experts: torch.Tensor | None = None,
    replay_routes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of ``batch["responses"]`` under ``model``.

    Runs ``model`` on ``input_ids [n, P+T]`` and keeps only the ``T`` positions that predict the
    response (``logits_to_keep``), so the LM head never sees the prompt. Logits are divided by
    ``temperature`` to match the sampling distribution of the engine. Returns ``log_probs [n, T]``
    and ``entropy [n, T]`` (or ``None``), both float32. The entropy carries gradients only with
    ``entropy_grad``.

    The LM head runs in chunks of ``chunk_tokens`` tokens (default: 32 MiB of fp32 logits per
    chunk on CPU, see :mod:`rltrainer.lm_head`), so ``[n, T, V]`` logits are never held, and the
    backward recomputes each chunk. This needs a plain ``nn.Linear`` head without bias applied
    last (transformers causal LMs; a model may instead offer ``lm_head_log_probs``, as megatron's
    does); other models (a LoRA-wrapped head, logit soft-capping) take the full-logits path, as
    does ``chunk_tokens=0``.

    Columns that are padding in every row of ``batch`` (a micro-batch) are left out: the left
    padding up to its longest prompt and the right padding past its longest response, so a
    micro-batch of short rows does not pay for the longest rows of the step; the outputs there are
    0. With ``padding_free`` (default: ``batch.padding_free``, which the Strategy sets on its
    micro-batches when built with ``padding_free=True``) the rows run as one packed sequence
    without their padding (:mod:`rltrainer.packing`); the LM head sees only the real response
    tokens, and response padding gets 0 in both outputs.

    ``routed_experts [n, P+T, L, K]`` (int, aligned with ``input_ids``; the batch field of that
    name): for a mixture-of-experts model, the experts to use for each token and decoder layer
    instead of its router's own top-k (routing replay, R3; -1: route as the router does), with the
    gate weights taken from the router's scores over those experts (:mod:`rltrainer.models.moe`).
    With ``replay_routes=False`` they are only compared with the router's own choice (the
    ``moe/routing_agreement`` of a :func:`~rltrainer.models.moe.recording`).
    """
    with embedding_into_grad(model):  # inside gradients_into_parameters only (the training step's)
        return _response_log_probs(model, batch, temperature, with_entropy, entropy_grad, chunk_tokens, padding_free,
                                   routed_experts, replay_routes)


def _response_log_probs(model: torch.nn.Module, batch: RolloutBatch, temperature: float, with_entropy: bool,
                        entropy_grad: bool, chunk_tokens: int | None, padding_free: bool | None,
                        routed_experts: torch.Tensor | None = None, replay_routes: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    responses = batch["responses"]  # [n, T]
    T = responses.shape[1]
    if padding_free is None:
        padding_free = getattr(batch, "padding_free", False)  # a plain dict of tensors runs padded
    if padding_free:
        return _packed_log_probs(model, batch, temperature, with_entropy, entropy_grad, chunk_tokens, routed_experts,
                                 replay_routes)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"])
    if chunk_tokens != 0 and hasattr(model, "lm_head_log_probs"):  # megatron's model: its own shapes
        routes = {"routed_experts": routed_experts, "replay_routes": replay_routes} if routed_experts is not None else {}
        log_probs, entropy = model.lm_head_log_probs(**inputs, targets=responses, temperature=temperature,
                                                     chunk_tokens=chunk_tokens, **routes)
        return log_probs, _entropy(entropy, with_entropy, entropy_grad)
    width = inputs["input_ids"].shape[1]
    inputs, kept = trim_padding_columns(inputs, T)
    responses = responses[:, :kept]
    head = chunkable_head(model) if chunk_tokens != 0 else None
    start = width - T + kept - inputs["input_ids"].shape[1]  # the first column kept
    routes = None if routed_experts is None else routed_experts[:, start : width - T + kept].flatten(0, 1)
    with replaying(model, routes, inputs["attention_mask"].flatten().bool(), replay_routes):
        if head is not None:
            with _head_returns_log_probs(model, *head, responses, temperature, chunk_tokens):
                out = model(**inputs, use_cache=False, logits_to_keep=kept + 1).logits  # [n, kept, 2]
            log_probs, entropy = out[..., 0], _entropy(out[..., 1], with_entropy, entropy_grad)
        else:
            logits = model(**inputs, use_cache=False, logits_to_keep=kept + 1).logits[:, :-1]  # P-1+t predicts t
            log_probs, entropy = _log_probs_from_logits(logits, responses, temperature, with_entropy, entropy_grad)
    return pad_columns(log_probs, T), None if entropy is None else pad_columns(entropy, T)


def trim_padding_columns(inputs: dict[str, torch.Tensor], T: int) -> tuple[dict[str, torch.Tensor], int]:
    """``inputs`` (``input_ids``, ``attention_mask``, ``position_ids``, each ``[n, P+T]``: left-padded
    prompts, then right-padded responses of ``T`` columns) without the columns that are padding in
    every row, and how many response columns remain (at least 1). The last prompt column (it
    predicts the first response token) always stays. Exact: a column every row masks out changes
    no other position's attention, and positions come from ``position_ids``."""
    mask = inputs["attention_mask"]
    P = mask.shape[1] - T
    real = mask.bool().any(0).nonzero()  # [k, 1] columns some row attends
    if len(real) == 0:
        return inputs, T
    first, last = int(real[0]), int(real[-1])
    start, kept = min(first, P - 1), min(T, max(1, last + 1 - P))
    if start == 0 and kept == T:
        return inputs, T
    return {k: v[:, start : P + kept] for k, v in inputs.items()}, kept


def pad_columns(x: torch.Tensor, T: int) -> torch.Tensor:
    """``x [n, kept]`` with zeros appended up to ``T`` columns."""
    return x if x.shape[1] == T else F.pad(x, (0, T - x.shape[1]))


def _packed_log_probs(model: torch.nn.Module, batch: RolloutBatch, temperature: float, with_entropy: bool,
                      entropy_grad: bool, chunk_tokens: int | None, routed_experts: torch.Tensor | None,
                      replay_routes: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`response_log_probs` on the rows packed into one sequence (:mod:`rltrainer.packing`)."""
    if hasattr(model, "lm_head_log_probs"):
        raise NotImplementedError(f"{type(model).__name__} computes its own log-probs (megatron's model) and takes "
                                  "padded rows only: turn padding_free off for it")
    packed = packed_rows_for(model, batch)
    targets = batch["responses"][packed.rows, packed.cols][None]  # [1, M]
    head = chunkable_head(model) if chunk_tokens != 0 else None
    routes = None if routed_experts is None else routed_experts[batch["attention_mask"].bool()]  # [L_packed, L, K]
    with replaying(model, routes, None, replay_routes):
        if head is not None:
            with _head_returns_log_probs(model, *head, targets, temperature, chunk_tokens):
                out = model(**packed.inputs, use_cache=False, logits_to_keep=packed.predictors).logits[0]  # [M, 2]
            log_probs, entropy = out[:, 0], _entropy(out[:, 1], with_entropy, entropy_grad)
        else:
            logits = model(**packed.inputs, use_cache=False, logits_to_keep=packed.predictors).logits  # [1, M, V]
            log_probs, entropy = _log_probs_from_logits(logits, targets, temperature, with_entropy, entropy_grad)
            log_probs, entropy = log_probs[0], None if entropy is None else entropy[0]
    return packed.unpack(log_probs), None if entropy is None else packed.unpack(entropy)


def _log_probs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                           entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets [n, T]`` and entropies from full ``logits [n, T, V]``, in fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_softmax = logits.log_softmax(-1)  # one fused pass; faster than logsumexp on CPU
    log_probs = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = entropy_from_log_softmax(log_softmax if entropy_grad else log_softmax.detach())
    return log_probs, entropy


def _entropy(entropy: torch.Tensor, with_entropy: bool, entropy_grad: bool) -> torch.Tensor | None:
    if not with_entropy:
        return None
    return entropy if entropy_grad else entropy.detach()


@contextlib.contextmanager
def _head_returns_log_probs(model: torch.nn.Module, head: torch.nn.Linear, output: HeadOutput, responses: torch.Tensor,
                            temperature: float, chunk_tokens: int | None) -> Iterator[None]:
    """Inside it, ``head(hidden [n, T+1, H])`` returns ``[n, T, 2]``: the log-probs of
    ``responses [n, T]`` and the entropies, computed in chunks from ``head.weight`` (with the
    model's ``output`` transform). The work runs inside the head's call, so a sharded model's
    gathered weight (FSDP2) is what it reads."""
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        n, T = responses.shape
        h = hidden[:, :T].reshape(n * T, hidden.shape[-1])  # position P-1+t predicts response t
        log_probs, entropy = chunked_log_probs(h, head.weight, responses.reshape(-1), temperature, chunk_tokens,
                                               scale=output.scale, softcap=output.softcap)
        return torch.stack([log_probs, entropy], -1).view(n, T, 2)

    with head_forward(head, forward), output.returned_as_is(model):
        yield


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., tokens]``."""
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_log_softmax(log_softmax: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum(p * log p)`` over the last dimension, from ``log_softmax(logits)``."""
    return -(log_softmax.exp() * log_softmax).sum(-1)

"""The chunked LM head (rltrainer/lm_head.py): log-probs and entropies of the response tokens, and
their gradients, equal the full-logits path within fp32 rounding, with and without temperature,
tied and untied heads, on one device and on FSDP2 (2 gloo ranks). Megatron's vocabulary-parallel
head: tests/strategies/test_megatron_cpu.py.

Tolerances: both paths compute the same fp32 products and sums in another order (chunks, a
max-shifted sum instead of log_softmax); observed differences are ~1e-7 on log-probs of size ~7
and ~1e-8 on gradients; 1e-5 / 1e-6 leave room, far below a wrong term (a gradient without the
entropy term or the temperature is off by > 1e-3)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from rltrainer.lm_head import chunked_log_probs
from rltrainer.models import build_causal_lm, response_log_probs
from rltrainer.testing import tiny_qwen2_config

VOCAB, P, T, ROWS = 300, 5, 9, 3


def config(tied: bool):
    config = tiny_qwen2_config(VOCAB, hidden_size=32)
    config.tie_word_embeddings = tied
    return config


def full_reference(h, weight, targets, temperature):
    log_softmax = ((h @ weight.t()) / temperature).log_softmax(-1)
    return log_softmax.gather(1, targets[:, None]).squeeze(1), -(log_softmax.exp() * log_softmax).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_values_and_gradients_equal_full_logits(temperature, entropy_grad):
    torch.manual_seed(0)
    h = torch.randn(50, 16, requires_grad=True)
    weight = torch.randn(VOCAB, 16, requires_grad=True)
    targets = torch.randint(0, VOCAB, (50,))
    g_lp, g_ent = torch.randn(50), torch.randn(50)
    results = []
    for fn in (lambda: chunked_log_probs(h, weight, targets, temperature, chunk_tokens=7),
               lambda: full_reference(h, weight, targets, temperature)):
        log_probs, entropy = fn()
        loss = (log_probs * g_lp).sum() + ((entropy * g_ent).sum() if entropy_grad else 0.0)
        results.append((log_probs, entropy, *torch.autograd.grad(loss, [h, weight])))
    for chunked, full in zip(*results):
        torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)


def test_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="chunk_tokens=-1"):
        chunked_log_probs(torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long), chunk_tokens=-1)


def make_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    """Rows of prompt + response, row 0 left-padded by 2 tokens, as the hooks see them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, P + T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, P:]}


def log_probs_and_grads(model, batch, temperature, chunk_tokens):
    log_probs, entropy = response_log_probs(model, batch, temperature, with_entropy=True, entropy_grad=True,
                                            chunk_tokens=chunk_tokens)
    weights = torch.linspace(-1, 1, log_probs.numel()).view_as(log_probs)
    loss = (log_probs * weights).sum() + 0.5 * (entropy * weights.flip(-1)).sum()
    model.zero_grad()
    loss.backward()
    return log_probs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_transformers_model_chunked_equals_full_logits(tied, temperature):
    model = build_causal_lm(config(tied), seed=0)
    batch = make_batch()
    chunked = log_probs_and_grads(model, batch, temperature, chunk_tokens=4)
    full = log_probs_and_grads(model, batch, temperature, chunk_tokens=0)
    torch.testing.assert_close(chunked[0], full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[1], full[1], atol=1e-5, rtol=1e-5)
    assert chunked[2].keys() == full[2].keys()
    for name in full[2]:
        torch.testing.assert_close(chunked[2][name], full[2][name], atol=1e-6, rtol=1e-4, msg=name)
    assert "forward" not in model.get_output_embeddings().__dict__  # the head is restored
    with torch.no_grad():  # the compute stages: no graph, same values
        torch.testing.assert_close(response_log_probs(model, batch, temperature)[0], full[0], atol=1e-5, rtol=1e-5)


def test_a_head_with_bias_takes_the_full_logits_path():
    model = build_causal_lm(config(False), seed=0)
    head = model.get_output_embeddings()
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    batch = make_batch()
    log_probs, _ = response_log_probs(model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, P - 1:-1]
    expected = logits.log_softmax(-1).gather(-1, batch["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)


def _fsdp2_rank(rank: int, port: int, out: str, tied: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rltrainer.strategies.fsdp2 import shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = build_causal_lm(config(tied), seed=0)
    shard_model(model, init_device_mesh("cpu", (2,)), "32-true", cpu_offload=False, reshard_after_forward=True)
    log_probs, entropy, grads = log_probs_and_grads(model, make_batch(), 0.7, chunk_tokens=4)
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    if rank == 0:
        torch.save((log_probs, entropy, grads), out)
    dist.destroy_process_group()


@pytest.mark.parametrize("tied", [True, False])
def test_fsdp2_chunked_equals_one_device_full_logits(tied, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp_path, "rank0.pt")
    mp.spawn(_fsdp2_rank, args=(port, out, tied), nprocs=2)
    sharded = torch.load(out)
    model = build_causal_lm(config(tied), seed=0)
    full = log_probs_and_grads(model, make_batch(), 0.7, chunk_tokens=0)
    torch.testing.assert_close(sharded[0], full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sharded[1], full[1], atol=1e-5, rtol=1e-5)
    for name in full[2]:  # both ranks ran the batch; shard_model sums gradients over ranks
        torch.testing.assert_close(sharded[2][name] / 2, full[2][name], atol=1e-6, rtol=1e-4, msg=name)

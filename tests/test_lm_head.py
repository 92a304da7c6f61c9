"""The chunked LM head (rltrainer/lm_head.py): log-probs and entropies of the response tokens, and
their gradients, equal the full-logits path within fp32 rounding, with and without temperature,
tied and untied heads, on one device and on FSDP2 (2 gloo ranks). Megatron's vocabulary-parallel
head: tests/strategies/test_megatron_cpu.py.

Tolerances: both paths compute the same fp32 products and sums in another order (chunks, a
max-shifted sum instead of log_softmax); observed differences are ~1e-7 on log-probs of size ~7
and ~1e-8 on gradients; 1e-5 / 1e-6 leave room, far below a wrong term (a gradient without the
entropy term or the temperature is off by > 1e-3)."""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from rltrainer.lm_head import (CHUNK_ELEMENTS, CPU_CHUNK_TOKENS, chunk_tokens_for, chunked_log_probs,
                               gradients_into_parameters, vocab_block_for)
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
@pytest.mark.parametrize("vocab_block", [None, 64, 7])  # one block; 5 (the last of 44 rows); 43
def test_chunked_values_and_gradients_equal_full_logits(temperature, entropy_grad, vocab_block):
    torch.manual_seed(0)
    h = torch.randn(50, 16, requires_grad=True)
    weight = torch.randn(VOCAB, 16, requires_grad=True)
    weight.data[5, :] *= 8  # one large logit: the online softmax's running maximum moves between blocks
    targets = torch.randint(0, VOCAB, (50,))
    g_lp, g_ent = torch.randn(50), torch.randn(50)
    results = []
    for fn in (lambda: chunked_log_probs(h, weight, targets, temperature, chunk_tokens=7, vocab_block=vocab_block),
               lambda: full_reference(h, weight, targets, temperature)):
        log_probs, entropy = fn()
        loss = (log_probs * g_lp).sum() + ((entropy * g_ent).sum() if entropy_grad else 0.0)
        results.append((log_probs, entropy, *torch.autograd.grad(loss, [h, weight])))
    for chunked, full in zip(*results):
        torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale, softcap", [(0.25, None), (1.0, 2.0), (3.0, 5.0)])
def test_a_scaled_or_soft_capped_head_equals_its_full_logits(scale, softcap):
    """Granite's factor and Gemma 2's soft-cap inside the chunked head: values and gradients equal
    ``softcap * tanh(z * scale / softcap) / temperature`` through autograd (a soft-cap of 2 bends
    logits of size ~8 hard, so a missing ``1 - tanh^2`` would show)."""
    torch.manual_seed(0)
    h = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(VOCAB, 16, requires_grad=True)
    targets = torch.randint(0, VOCAB, (40,))
    g_lp, g_ent = torch.randn(40), torch.randn(40)
    results = []

    def reference():
        z = (h @ weight.t()) * scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        log_softmax = (z / 0.8).log_softmax(-1)
        return log_softmax.gather(1, targets[:, None]).squeeze(1), -(log_softmax.exp() * log_softmax).sum(-1)

    for fn in (lambda: chunked_log_probs(h, weight, targets, 0.8, chunk_tokens=7, vocab_block=64, scale=scale,
                                         softcap=softcap), reference):
        log_probs, entropy = fn()
        loss = (log_probs * g_lp).sum() + (entropy * g_ent).sum()
        results.append((log_probs, entropy, *torch.autograd.grad(loss, [h, weight])))
    for chunked, full in zip(*results):
        torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)


def test_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="chunk_tokens=-1"):
        chunked_log_probs(torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long), chunk_tokens=-1)
    with pytest.raises(ValueError, match="vocab_block=0"):
        chunked_log_probs(torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long), vocab_block=0)


def test_cpu_defaults_take_cache_sized_blocks():
    assert chunk_tokens_for(151_665, device="cpu") == CPU_CHUNK_TOKENS
    assert vocab_block_for(151_665, CPU_CHUNK_TOKENS, device="cpu") * CPU_CHUNK_TOKENS == CHUNK_ELEMENTS["cpu"]
    assert vocab_block_for(151_665, 2, device="cuda") == 151_665  # one block: the whole vocabulary
    assert chunk_tokens_for(151_665, device="cuda") == CHUNK_ELEMENTS["cuda"] // 151_665


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
@pytest.mark.parametrize("blocks", [False, True])
def test_transformers_model_chunked_equals_full_logits(tied, temperature, blocks, monkeypatch):
    if blocks:  # 4-token chunks in blocks of 128 vocabulary rows: 128, 128, 44
        monkeypatch.setitem(CHUNK_ELEMENTS, "cpu", 512)
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


def graph_nodes(tensor: torch.Tensor) -> dict[str, list]:
    """The autograd nodes behind ``tensor``, by type name."""
    out: dict[str, list] = {}
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.setdefault(type(node).__name__, []).append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return out


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("padding_free", [False, True])
def test_gradients_into_parameters_equal_autograds(tied, padding_free):
    """The training step's fused accumulation (head and embedding gradients added to ``.grad`` in
    the backward) gives autograd's gradients, over two micro-batches, with a padding_idx row."""
    cfg = config(tied)
    cfg.pad_token_id = 0  # nn.Embedding(padding_idx=0): its row gets no gradient
    batches = [make_batch(1), make_batch(2)]
    for b in batches:
        b["input_ids"][0, :2] = 0  # the left padding is the pad token
    grads, values = [], []
    for fused in (False, True):
        model = build_causal_lm(cfg, seed=0)
        assert model.get_input_embeddings().padding_idx == 0
        model.zero_grad(set_to_none=True)
        with gradients_into_parameters() if fused else contextlib.nullcontext():
            for b in batches:
                log_probs, entropy = response_log_probs(model, b, 0.8, with_entropy=True, entropy_grad=True,
                                                        chunk_tokens=4, padding_free=padding_free)
                weights = torch.linspace(-1, 1, log_probs.numel()).view_as(log_probs)
                loss = (log_probs * weights).sum() + 0.5 * (entropy * weights.flip(-1)).sum()
                nodes = graph_nodes(loss)
                assert ("_EmbeddingIntoGradBackward" in nodes) == fused
                assert [n.options.into_grad for n in nodes.get("_ChunkedHeadBackward", [])] == [fused]
                loss.backward()
                values.append(log_probs.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert "forward" not in model.get_input_embeddings().__dict__  # the embedding is restored
    torch.testing.assert_close(values[:2], values[2:], rtol=0, atol=0)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)
    embedding = grads[1]["model.embed_tokens.weight"]
    if not tied:
        assert embedding[0].abs().max() == 0  # the padding row
    assert embedding.abs().sum() > 0


def test_gradients_into_parameters_leave_other_tensors_to_autograd():
    """Outside a parameter (a plain tensor, a frozen weight, autograd.grad on them) nothing changes."""
    torch.manual_seed(0)
    h = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)  # a tensor, not an nn.Parameter
    targets = torch.randint(0, 40, (12,))
    with gradients_into_parameters():
        log_probs, _ = chunked_log_probs(h, weight, targets, chunk_tokens=5)
        inside = torch.autograd.grad(log_probs.sum(), [h, weight])
    log_probs, _ = chunked_log_probs(h, weight, targets, chunk_tokens=5)
    outside = torch.autograd.grad(log_probs.sum(), [h, weight])
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    assert weight.grad is None


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

    from rltrainer.strategies.fsdp2.sharding import shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = build_causal_lm(config(tied), seed=0)
    shard_model(model, init_device_mesh("cpu", (2,)), "32-true", cpu_offload=False, reshard_after_forward=True)
    log_probs, entropy, grads = log_probs_and_grads(model, make_batch(), 0.7, chunk_tokens=4)
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    if rank == 0:
        torch.save((log_probs, entropy, grads), out)
    dist.barrier()  # both ranks done before either tears down (rank 0 holds the store)
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


def _vocab_parallel_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    h, weight, targets, g_lp, g_ent = torch.load(out + ".in")
    h = h.clone().requires_grad_(True)
    rows = weight.shape[0] // 2  # rank r holds rows r*rows ...; the real vocabulary ends 20 rows early
    local = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
    log_probs, entropy = chunked_log_probs(h, local, targets, 0.7, chunk_tokens=6, group=dist.group.WORLD,
                                           vocab_start=rank * rows, vocab_size=weight.shape[0] - 20, vocab_block=32)
    ((log_probs * g_lp).sum() + (entropy * g_ent).sum()).backward()
    grad_h = h.grad.clone()
    dist.all_reduce(grad_h)  # each rank's part of the hidden states' gradient
    torch.save((log_probs.detach(), entropy.detach(), grad_h, local.grad), f"{out}.{rank}")
    dist.barrier()  # both ranks done before either tears down (rank 0 holds the store)
    dist.destroy_process_group()


def test_vocabulary_parallel_blocks_equal_full_logits(tmp_path):
    """Two ranks, each half of a padded head in blocks of 32 rows: the all-reduced online-softmax
    statistics give the one-device values and gradients (rank 1's last 20 rows are padding)."""
    torch.manual_seed(0)
    h, weight = torch.randn(20, 16), torch.randn(VOCAB, 16)
    targets, g_lp, g_ent = torch.randint(0, VOCAB - 20, (20,)), torch.randn(20), torch.randn(20)
    out = os.path.join(tmp_path, "rank")
    torch.save((h, weight, targets, g_lp, g_ent), out + ".in")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_vocab_parallel_rank, args=(port, out), nprocs=2)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    h_ref, w_ref = h.clone().requires_grad_(True), weight[: VOCAB - 20].clone().requires_grad_(True)
    log_probs, entropy = full_reference(h_ref, w_ref, targets, 0.7)
    ((log_probs * g_lp).sum() + (entropy * g_ent).sum()).backward()
    for rank in ranks:
        torch.testing.assert_close(rank[0], log_probs.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rank[1], entropy.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rank[2], h_ref.grad, atol=1e-5, rtol=1e-5)
    grad_w = torch.cat([ranks[0][3], ranks[1][3]])
    torch.testing.assert_close(grad_w[: VOCAB - 20], w_ref.grad, atol=1e-5, rtol=1e-5)
    assert grad_w[VOCAB - 20:].abs().max() == 0  # padding rows get no gradient

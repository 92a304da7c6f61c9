"""megatron-core on CPU: a GPTModel with tensor parallelism 2 over gloo, built by the library's
``build_gpt`` (its config conversion, ``megatron_config``) with weights converted from a
transformers model by ``hf_to_megatron``; prints (as JSON) how far its logits, loss and gradients
(reduced as the worker reduces them, converted back by ``megatron_to_hf``) are from the
single-device transformers model's. Run by tests/strategies/test_megatron_cpu.py; runnable alone:

    python tests/strategies/megatron_tp_check.py [CHECK ...]

A CHECK is a family (``qwen2``, ``llama3-rope``, ``qwen3``), optionally with ``:head``; the default
is ``qwen2`` (and ``FAMILY head`` still means ``FAMILY:head``). All checks run in one pair of
processes (megatron-core is imported and the group started once); one JSON line per check, in the
order given, each with its ``check``.

With ``head``, the outputs compared are the response tokens' log-probs and entropies
(``response_log_probs``: megatron's vocabulary-parallel head in chunks against transformers' full
logits, temperature 0.7, row 0 left-padded) and the gradients of a loss using both.

``qwen2``: QKV biases, tied embeddings. ``llama3-rope``: untied, and Llama 3.1's RoPE scaling
(``rope_type="llama3"``, factor 8; megatron's ``rope_scaling``) with ``rope_theta=5e5`` and
``head_dim=16``, so that several frequencies fall in the scaled and the smoothed bands (wavelengths
of 4.4e3 to 6e5 positions against 8192 / 4 and 8192) and a sequence of 24 turns them by up to
~0.3 rad. ``qwen3``: per-head q/k RMSNorm, ``heads x head_dim = 128 != hidden = 64``, untied.

megatron-core assumes CUDA in a few places: the library's CPU attention spec (``build_gpt(on_cpu=True)``)
replaces ``DotProductAttention``, and ``torch.cuda.current_device`` is pointed at the CPU here
(``rltrainer.strategies.megatron.cpu.cpu_shims``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

VOCAB, HIDDEN, LAYERS, HEADS, GROUPS, FFN, SEQ, BATCH = 128, 64, 2, 8, 2, 96, 24, 3
RESPONSE, TEMPERATURE = 10, 0.7  # the ``head`` check: response tokens, sampling temperature
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def hf_config(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=GROUPS, rms_norm_eps=1e-6)
    if family == "qwen2":
        return Qwen2Config(**sizes, tie_word_embeddings=True, rope_theta=10000.0)
    if family == "llama3-rope":
        return LlamaConfig(**sizes, head_dim=16, tie_word_embeddings=False, max_position_embeddings=16384,
                           rope_parameters=dict(LLAMA3))
    if family == "qwen3":
        return Qwen3Config(**sizes, head_dim=16, tie_word_embeddings=False, rope_theta=1e6)
    raise ValueError(f"unknown family {family!r}: qwen2, llama3-rope or qwen3")


def head_batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The last ``RESPONSE`` tokens of ``ids`` as responses; row 0 left-padded by 3 (rotation)."""
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "responses": ids[:, -RESPONSE:]}


def head_loss(log_probs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """A loss using both outputs with unequal per-token weights, so every gradient term shows."""
    weights = torch.linspace(-1.0, 1.0, log_probs.numel()).view_as(log_probs)
    return (log_probs * weights).sum() + (entropy * weights.flip(-1)).sum() * 0.5


def rank_main(rank: int, world: int, port: int, workdir: str, checks: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    from rltrainer.strategies.megatron.cpu import cpu_shims

    cpu_shims()  # megatron-core places RoPE frequencies and buffers with torch.cuda.current_device()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    for check in checks:
        try:
            rank_check(rank, world, workdir, check)
        except Exception as exc:
            exc.add_note(f"in check {check!r} (rank {rank})")
            raise
    dist.destroy_process_group()


def rank_check(rank: int, world: int, workdir: str, check: str) -> None:
    """One check on this rank: the tensor-parallel model's outputs and gradients, to ``tp-<check>.pt``."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rltrainer.strategies.megatron.layouts import MegatronLayout, hf_to_megatron, megatron_to_hf
    from rltrainer.strategies.megatron.models import build_gpt

    family, head = parse_check(check)
    torch.manual_seed(0)
    data = torch.load(os.path.join(workdir, f"inputs-{check}.pt"))
    layout, config = MegatronLayout(tp=world), hf_config(family)
    shards = hf_to_megatron(data["state"], config, layout)
    model = build_gpt(config, tp=world, on_cpu=True, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(shards[0][rank], strict=False)
    missing = [m for m in missing if not m.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    ids = data["ids"]
    if head:  # the response tokens' log-probs and entropies from the vocabulary-parallel head in chunks
        from rltrainer.models import response_log_probs
        from rltrainer.strategies.megatron.models import MegatronCausalLM

        log_probs, entropy = response_log_probs(MegatronCausalLM(model, config), head_batch(ids), TEMPERATURE,
                                                with_entropy=True, entropy_grad=True, chunk_tokens=7)
        logits, loss = torch.stack([log_probs, entropy]), head_loss(log_probs, entropy)
    else:
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        logits = gather_from_tensor_model_parallel_region(model(ids, positions, attention_mask=None))  # [b, s, V]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    for name, param in model.named_parameters():  # Qwen3's q/k norms: each TP rank saw its own heads; the
        if "q_layernorm" in name or "k_layernorm" in name:  # worker's finalize_model_grads sums them over TP
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())  # (:353-355)
    grads = {n: p.grad for n, p in model.named_parameters()}
    gathered = [None] * world
    dist.all_gather_object(gathered, grads)
    if rank == 0:
        grad_shards = [[{n: g[n] for n in g} for g in gathered]]
        torch.save({"logits": logits.detach(), "loss": loss.detach(),
                    "grads": megatron_to_hf(grad_shards, config, layout)}, os.path.join(workdir, f"tp-{check}.pt"))


def parse_check(check: str) -> tuple[str, bool]:
    """``"qwen3"`` -> ("qwen3", False); ``"qwen2:head"`` -> ("qwen2", True)."""
    family, _, what = check.partition(":")
    if what not in ("", "head"):
        raise ValueError(f"unknown check {check!r}: FAMILY or FAMILY:head (FAMILY: qwen2, llama3-rope or qwen3)")
    hf_config(family)  # raises for an unknown family
    return family, what == "head"


def reference_outputs(check: str, workdir: str) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The single-device transformers model of ``check``: saves its weights and inputs for the ranks;
    returns it (with gradients) and its logits (or log-probs and entropies) and loss."""
    from transformers import AutoModelForCausalLM

    family, head = parse_check(check)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="sdpa")
    with torch.no_grad():
        for p in reference.parameters():  # non-trivial norms and biases
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    if head:  # the full-logits path of transformers
        from rltrainer.models import response_log_probs

        log_probs, entropy = response_log_probs(reference, head_batch(ids), TEMPERATURE, with_entropy=True,
                                                entropy_grad=True, chunk_tokens=0)
        logits, loss = torch.stack([log_probs, entropy]), head_loss(log_probs, entropy)
    else:
        logits = reference(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    torch.save({"state": {n: p.detach() for n, p in reference.named_parameters()}, "ids": ids},
               os.path.join(workdir, f"inputs-{check}.pt"))
    return reference, logits.detach(), loss.detach()


def main(checks: list[str]) -> None:
    import socket

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        references = {check: reference_outputs(check, workdir) for check in checks}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port, workdir, checks), nprocs=2)
        for check, (reference, logits, loss) in references.items():
            tp = torch.load(os.path.join(workdir, f"tp-{check}.pt"))
            grad_diff = max((tp["grads"][n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
            print(json.dumps({"check": check, "logits_max_abs_diff": (tp["logits"] - logits).abs().max().item(),
                              "loss_tp2": tp["loss"].item(), "loss_hf": loss.item(), "grad_max_abs_diff": grad_diff,
                              "grad_names": len(tp["grads"]),
                              "hf_params": len(dict(reference.named_parameters()))}))
    sys.stdout.flush()


def checks_of(argv: list[str]) -> list[str]:
    """The checks named on the command line (``FAMILY head``: the old spelling of ``FAMILY:head``)."""
    if len(argv) == 2 and argv[1] == "head" and ":" not in argv[0]:
        return [f"{argv[0]}:head"]
    return argv or ["qwen2"]


if __name__ == "__main__":
    main(checks_of(sys.argv[1:]))

"""Routing replay through megatron-core's router, on CPU: two gloo ranks, experts split over them
(``expert_model_parallel_size=2``; each rank runs its own rows, tokens reach their experts by
megatron's all-to-all), a ``GPTModel`` built by the library's ``build_gpt`` and filled by
``megatron_shard``, against the single-device transformers model whose routers replay the same
routes (the reference below, independent of ``rltrainer.models.moe``: softmax over all experts, the
given experts' scores, renormalised when the config renormalises; -1: the router's own top-k).
Prints one JSON line per check. Run by tests/strategies/test_megatron_moe.py; runnable alone:

    python tests/strategies/megatron_moe_check.py [qwen3_moe] [mixtral]

The routes given are, in every layer and token, the experts the router ranks last (so none is one
it would choose: built layer by layer, as each layer's scores depend on the routes before it),
except row 1's columns 5-7, which are -1 (the router's own choice). Compared: the experts megatron's
routers select (recorded in ``RouteReplay``), the response log-probs and entropies (temperature 0.7,
chunks of 7 tokens; rows 0 and 2 left-padded), and the gradients of a loss using both (dense ones
summed over the ranks, experts gathered over them), converted to transformers' names.
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

VOCAB, ROWS, SEQ, RESPONSE, TEMPERATURE = 128, 4, 20, 8, 0.7
FALLBACK_ROW, FALLBACK_COLUMNS = 1, slice(5, 8)


def hf_config(family: str) -> Any:
    from transformers import MixtralConfig, Qwen3MoeConfig

    sizes = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_experts_per_tok=2, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**sizes, intermediate_size=64, moe_intermediate_size=24, head_dim=16, num_experts=8,
                              norm_topk_prob=True)
    if family == "mixtral":
        return MixtralConfig(**sizes, intermediate_size=24, num_local_experts=4)
    raise ValueError(f"unknown check {family!r}: qwen3_moe or mixtral")


def inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :2] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, -RESPONSE:]}


def loss_of(log_probs: torch.Tensor, entropy: torch.Tensor, rows: slice) -> torch.Tensor:
    """A loss of both outputs, with per-token weights fixed over the whole batch (so that each rank's
    rows add up to the whole batch's loss)."""
    weights = torch.linspace(-1.0, 1.0, ROWS * RESPONSE).view(ROWS, RESPONSE)[rows]
    return (log_probs * weights).sum() + 0.5 * (entropy * weights.flip(-1)).sum()


class HFRouting:
    """transformers' routers replaying ``routes [b, s, L, K]`` (or routing as they do, ``None``),
    recording each layer's chosen experts ``[b * s, K]`` and probabilities ``[b * s, E]``."""

    def __init__(self, model: Any, renormalise: bool) -> None:
        self.routes: torch.Tensor | None = None
        self.chosen: dict[int, torch.Tensor] = {}
        self.probs: dict[int, torch.Tensor] = {}
        for layer, block in enumerate(model.model.layers):
            block.mlp.gate.forward = self._forward(block.mlp.gate, layer, renormalise)

    def _forward(self, router: Any, layer: int, renormalise: bool) -> Any:
        def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            hidden = hidden.reshape(-1, router.hidden_dim)
            logits = F.linear(hidden, router.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            chosen = torch.topk(probs, router.top_k, dim=-1).indices
            if self.routes is not None:
                given = self.routes[:, :, layer].reshape(-1, router.top_k).long()
                chosen = torch.where((given >= 0).all(-1, keepdim=True), given, chosen)
            weights = probs.gather(1, chosen)
            if renormalise:
                weights = weights / weights.sum(-1, keepdim=True)
            self.chosen[layer], self.probs[layer] = chosen, probs.detach()
            return logits, weights.to(logits.dtype), chosen

        return forward


def reference(family: str) -> dict[str, Any]:
    """The single-device transformers model: own routes, the routes to replay, and the replayed
    log-probs, entropies and gradients."""
    from transformers import AutoModelForCausalLM

    from rltrainer.strategies.megatron.config import renormalised

    config = hf_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    with torch.no_grad():  # routers far from uniform: top-k choices are not near ties
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if name.endswith("gate.weight") else 0.2) if p.dim() > 1
                    else 1 + 0.1 * torch.randn_like(p))
    routing = HFRouting(model, renormalised(config))
    batch = inputs()

    def run() -> tuple[torch.Tensor, torch.Tensor]:  # the full logits (not rltrainer's own MoE replay)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -RESPONSE - 1:-1] / TEMPERATURE
        log_p = logits.float().log_softmax(-1)
        return log_p.gather(-1, batch["responses"][..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)

    own_lp, _ = run()
    own = {layer: c.view(ROWS, SEQ, -1) for layer, c in routing.chosen.items()}
    k = config.num_experts_per_tok
    routes = torch.full((ROWS, SEQ, config.num_hidden_layers, k), -1, dtype=torch.int16)
    for layer in range(config.num_hidden_layers):  # each layer's scores depend on the routes before it
        routing.routes = routes
        run()
        last = routing.probs[layer].topk(k, largest=False).indices.view(ROWS, SEQ, k).to(torch.int16)
        last[FALLBACK_ROW, FALLBACK_COLUMNS] = -1
        routes[:, :, layer] = last
    routing.routes = routes
    log_probs, entropy = run()
    loss_of(log_probs, entropy, slice(None)).backward()
    return {"config": config, "state": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "routes": routes,
            "own_routes": own, "own_log_probs": own_lp.detach(), "log_probs": log_probs.detach(),
            "entropy": entropy.detach(), "batch": batch,
            "replayed": {layer: c.view(ROWS, SEQ, -1) for layer, c in routing.chosen.items()}}


def same_experts(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` ``[b, s, K]`` name the same experts (in any slot order) at every real token."""
    return bool((a.sort(-1).values == b.sort(-1).values).all(-1)[mask.bool()].all())


def rank_check(rank: int, world: int, family: str, ref: dict[str, Any]) -> dict[str, Any] | None:
    from megatron.core import parallel_state

    from rltrainer.models import response_log_probs
    from rltrainer.strategies.megatron.layouts import (MegatronLayout, expert_stack, hf_from_megatron, megatron_shard,
                                                       stack_experts, state_reader)
    from rltrainer.strategies.megatron.models import MegatronCausalLM, build_gpt, rotate_back, rotate_left
    from rltrainer.strategies.megatron.routing import routers

    config, layout = ref["config"], MegatronLayout(ep=world)
    gpt = build_gpt(config, tp=1, on_cpu=True, dtype=torch.float32, ep=world)
    params = dict(gpt.named_parameters())
    with torch.no_grad():
        for name, tensor in megatron_shard(state_reader(ref["state"]), config, layout, 0, 0, ep_rank=rank):
            params[name].copy_(tensor)
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (own top-k, what the router used)
    for layer, router in routers(gpt).items():
        replay = router.router_replay
        original = replay.get_replay_topk

        def record(scores: torch.Tensor, topk: int, num_groups: Any = None, group_topk: Any = None,
                   default_compute_topk: Any = None, layer: int = layer, original: Any = original
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            values, used = original(scores, topk, num_groups, group_topk, default_compute_topk)
            recorded[layer] = (default_compute_topk(scores, topk)[1], used)
            return values, used

        replay.get_replay_topk = record
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    batch = {k: v[rows] for k, v in ref["batch"].items()}
    mask, (_, _, pads) = batch["attention_mask"], rotate_left(batch["input_ids"], batch["attention_mask"])
    model = MegatronCausalLM(gpt, config)

    def as_rows(tokens: torch.Tensor) -> torch.Tensor:  # router order [s * b, K], left-aligned -> [b, s, K]
        n = len(mask)
        return rotate_back(tokens.view(SEQ, n, -1).transpose(0, 1), pads)

    with torch.no_grad():
        own_lp, _ = response_log_probs(model, batch, TEMPERATURE, chunk_tokens=7)
    own_equal = all(same_experts(as_rows(recorded[l][1]), ref["own_routes"][l][rows], mask) for l in recorded)
    routes = ref["routes"][rows]
    log_probs, entropy = response_log_probs(model, batch, TEMPERATURE, with_entropy=True, entropy_grad=True,
                                            chunk_tokens=7, routed_experts=routes)
    loss_of(log_probs, entropy, rows).backward()
    given = (routes >= 0).all(-1)  # [b, s, L]
    replayed_equal, fallback_equal, differs = True, True, []
    for layer, (own, used) in recorded.items():
        used, own, real = as_rows(used), as_rows(own), mask.bool()
        replayed_equal &= bool((used == routes[:, :, layer].long()).all(-1)[real & given[:, :, layer]].all())
        fallback_equal &= same_experts(used, ref["replayed"][layer][rows], mask)
        overlap = (used[..., :, None] == own[..., None, :]).any(-1).any(-1)  # [b, s] shares an expert with its own
        differs.append((~overlap)[real & given[:, :, layer]].float())
    grads = {}
    for name, p in params.items():  # dense: summed over the ranks' rows; experts: gathered over the ranks
        stack = expert_stack(name)
        if stack is None:
            dist.all_reduce(p.grad)
            grads.update(hf_from_megatron(name, [p.grad], config, layout))
        elif stack[1] == 0:
            local = stack_experts({n: q.grad for n, q in params.items()}, stack[0])
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local, group=parallel_state.get_expert_model_parallel_group())
            grads.update(hf_from_megatron(stack[0], [torch.cat(parts)], config, layout))
    flags = torch.tensor([own_equal, replayed_equal, fallback_equal], dtype=torch.float)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    diffs = torch.stack([(log_probs - ref["log_probs"][rows]).abs().max(), (entropy - ref["entropy"][rows]).abs().max(),
                         (own_lp - ref["own_log_probs"][rows]).abs().max(),
                         (ref["log_probs"][rows] - ref["own_log_probs"][rows]).abs().max()]).detach()
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    share = torch.cat(differs).mean().reshape(1)
    dist.all_reduce(share, op=dist.ReduceOp.MIN)
    if rank != 0:
        return None
    return {"check": family, "own_routes_equal": bool(flags[0]), "replayed_routes_equal": bool(flags[1]),
            "fallback_routes_equal": bool(flags[2]), "replay_differs_from_own": share.item(),
            "log_probs_max_abs_diff": max(diffs[0].item(), diffs[1].item()), "no_replay_max_abs_diff": diffs[2].item(),
            "replay_moved_log_probs": diffs[3].item(),
            "router_grad_norms": [grads[f"model.layers.{i}.mlp.gate.weight"].norm().item()
                                  for i in range(config.num_hidden_layers)],
            "grad_max_abs_diff": max((grads[n] - g).abs().max().item() for n, g in ref["grads"].items()),
            "grad_max_rel_diff": max(((grads[n] - g).abs().max() / g.abs().max()).item()
                                     for n, g in ref["grads"].items()),
            "grad_names": sorted(grads) == sorted(ref["grads"])}


def rank_main(rank: int, world: int, port: int, families: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    from rltrainer.strategies.megatron.cpu import cpu_shims

    cpu_shims()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    for family in families:
        result = rank_check(rank, world, family, reference(family))
        if result is not None:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()


def main(families: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, port, families), nprocs=2)


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3_moe", "mixtral"])

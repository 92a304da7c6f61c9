"""The routing part: for a mixture-of-experts policy, routing replay (R3) and the routers'
load-balancing loss, with the MoE metrics (:mod:`rltrainer.models.moe`). A dense policy is
untouched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rltrainer.algorithms.part import Part, Update
from rltrainer.data.batch import RolloutBatch
from rltrainer.values import check_float

ROUTING_REPLAY = ("rollout", "compare", "off")


@dataclass
class Routing(Part):
    """How a MoE policy's routers are trained.

    Args:
        routing_replay: ``"rollout"`` (R3, the default): the engine records the experts it routed
            each token to (the batch field ``routed_experts``), and every training forward over
            those rows (old log-probs, reference log-probs, the update) uses them instead of the
            router's own top-k, the gate weights taken from the router's scores at those experts
            (so the router still learns). ``"compare"``: the engine records routes, the trainer
            routes by itself and logs ``moe/routing_agreement`` (the share of (token, layer) whose
            router top-k is the engine's). ``"off"``: no routes recorded. With ``"rollout"`` the
            agreement is logged too (the router's own choice, before replay). The default is
            chosen from the measurements in ``tests/benchmarks/README.md`` ("Routing replay"):
            with replay, the train/inference log-prob mismatch of a bf16 MoE drops.
        router_aux_loss_coef: the weight of the routers' load-balancing loss (Switch Transformer's,
            as transformers' ``load_balancing_loss_func``; ``moe/aux_loss``); ``None``: the policy
            config's ``router_aux_loss_coef`` (0 where it has none, e.g. DeepSeek-V3's
            aux-loss-free routing). 0 keeps the loss out. As Megatron-LM's default ``aux_loss``, it
            is each micro-batch's own, weighted by its share of the response tokens, so (alone among
            the loss's terms) it depends on the micro-batch split.

    Logged every step for a MoE policy: ``moe/expert_share/{max,min}``, ``moe/tokens_per_expert/*``,
    ``moe/router_entropy``, ``moe/aux_loss``, each also per layer (``moe/layer{l}/...``), and
    ``moe/routing_agreement`` where routes are recorded
    (:func:`~rltrainer.models.moe.summarize_routing_metrics`).
    """

    routing_replay: str = "rollout"
    router_aux_loss_coef: float | None = None

    kind: ClassVar[str] = "routing"
    reads: ClassVar[tuple[str, ...]] = ("routed_experts",)

    def __post_init__(self) -> None:
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"routing_replay={self.routing_replay!r}; choose from {', '.join(map(repr, ROUTING_REPLAY))}"
                             " (replay the engine's routes, only compare with them, or neither)")
        self.router_aux_loss_coef = check_float("router_aux_loss_coef", self.router_aux_loss_coef, at_least=0,
                                                none="the config's", meaning="0: no load-balancing loss")

    @property
    def records_routes(self) -> bool:
        """Whether the engine records the routes (``"rollout"`` or ``"compare"``)."""
        return self.routing_replay != "off"

    def route_kwargs(self, micro_batch: RolloutBatch) -> dict[str, Any]:
        """The ``response_log_probs`` arguments for ``micro_batch``'s routes (none without them)."""
        if self.routing_replay == "off" or "routed_experts" not in micro_batch:
            return {}
        return {"routed_experts": micro_batch["routed_experts"], "replay_routes": self.routing_replay == "rollout"}

    def coefficient(self, policy: torch.nn.Module) -> float:
        if self.router_aux_loss_coef is not None:
            return self.router_aux_loss_coef
        config = policy.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)

    def update(self, u: Update) -> None:
        """The load-balancing loss (this micro-batch's, weighted by its share of the mini-batch's
        response tokens) and the routers' vector metrics."""
        record = u.routing
        if record is None:
            return
        share = float(u.micro_batch["response_mask"].sum()) / u.counts["global_tokens"]
        aux = record.aux_loss()
        coef = self.coefficient(u.models["policy"])
        if coef:
            u.add(coef * share * aux.to(u.log_probs.device))
        u.metrics["moe/aux_loss"] = aux.detach() * share
        u.metrics.update(record.metrics())

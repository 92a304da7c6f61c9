"""megatron-core's MoE routers under rltrainer's routing contract (:mod:`rltrainer.models.moe`):
routing replay (R3) through megatron's own hook, and the :class:`~rltrainer.models.moe.RoutingRecord`
(the ``moe/*`` metrics and the load-balancing loss of the ``Routing`` part) filled from megatron's
routers as transformers' are, so that a megatron policy trains and reports what a transformers one
does.

- :func:`router_class`: megatron-core's ``TopKRouter`` whose top-k is a :class:`RouteReplay` and
  which keeps its logits (with their graph) for the record while it routes.
- :class:`RouteReplay`: per router, the replay and the record of one forward.
- :func:`attach_routing`: a :class:`~rltrainer.strategies.megatron.models.MegatronCausalLM`'s
  routers become what :func:`rltrainer.models.moe.recording` records.
- :func:`replaying`: one forward's routes, valid tokens and whether to replay.

Tokens are the rows of megatron's router call: sequence-major over the forward's left-aligned rows
(``[s * b]``; :func:`~rltrainer.strategies.megatron.models.rotate_left`). The record's sums do not
depend on the order; the routes and valid tokens are laid out in it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


def without_te_router_gemm() -> None:
    """megatron-core 0.16.1's MoE router calls ``te_general_gemm`` when it is not ``None``
    (``transformer/moe/moe_utils.py:1192, 1225``), a name only its Transformer Engine import defines
    (lines 22-39; the ``except ImportError`` branch leaves it undefined): without Transformer Engine,
    on a GPU as on a CPU, the router's forward raises ``NameError: name 'te_general_gemm' is not
    defined``. Define it as ``None``, as that branch means to: the router then takes its
    ``torch.mm`` path (lines 1195-1196, 1235-1236)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@functools.cache
def router_class() -> type:
    """megatron-core's ``TopKRouter`` (``transformer/moe/router.py``) with a :class:`RouteReplay` as
    its ``router_replay`` (the hook ``topk_routing_with_score_function`` asks for the top-k,
    ``moe_utils.py:698-707``), which sees the logits of each call (``routing(logits)``, lines
    545-631) for the record. The MoE layer builds it from its spec (``MoESubmodules.router``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    class ReplayingRouter(TopKRouter):
        def __init__(self, config: Any, pg_collection: Any = None) -> None:
            super().__init__(config=config, pg_collection=pg_collection)
            self.router_replay = RouteReplay()

        def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> Any:
            self.router_replay.logits = logits.reshape(-1, self.config.num_moe_experts)  # [s * b, E]
            try:
                return super().routing(logits, padding_mask=padding_mask)
            finally:
                self.router_replay.logits = None

    return ReplayingRouter


def routers(gpt: torch.nn.Module) -> dict[int, Any]:
    """This stage's megatron-core routers by decoder layer, counted from 0 over the whole model (a
    router's ``layer_number`` is global and 1-based: ``transformer_layer.py:280, 371-372``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {m.layer_number - 1: m for m in gpt.modules() if isinstance(m, TopKRouter)}


class RouteReplay:
    """One router's top-k in one forward. Megatron-core's own ``RouterReplay`` (``router_replay.py``)
    replays whole layers from one global list of instances; this one replays per token and per
    model, keeps the router's own choice where a token has none, and fills the model's record.

    With ``routes [tokens, K]`` set and ``replay``, a token's experts are its row, and their
    weights are the router's scores gathered there: the softmax over all experts
    (``moe_router_pre_softmax``), or the top-k logits that megatron then renormalises by a softmax
    over them (``moe_utils.py:709-715``); so the router's weight still gets its gradient. A row
    holding any -1 takes the router's own top-k (as :mod:`rltrainer.models.moe` does). Without
    ``replay`` the routes are only compared with the router's choice. With the model's
    ``state.record`` set (:func:`rltrainer.models.moe.recording`), each call adds its logits, own
    and used experts, the routes and the real tokens (``valid [tokens]``) to it. (Megatron's fused
    router, ``moe_router_fusion``, would skip this hook; it is off.)"""

    def __init__(self) -> None:
        self.layer = 0
        self.state: Any = None  # the model's rltrainer.models.moe.MoERouting (attach_routing)
        self.routes: torch.Tensor | None = None  # [tokens, K] int64, -1: none
        self.valid: torch.Tensor | None = None  # [tokens] bool
        self.replay = True
        self.logits: torch.Tensor | None = None  # [tokens, E], set by the router while it routes

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        used, routes = own, None
        if self.routes is not None:
            if self.routes.shape != own.shape:
                raise ValueError(f"routed_experts give {tuple(self.routes.shape)} routes (tokens, experts per token) "
                                 f"to a router that sees {tuple(own.shape)}")
            routes = self.routes.to(scores.device)
            if self.replay:
                used = torch.where((routes >= 0).all(-1, keepdim=True), routes, own)  # [tokens, K]
                values = scores.gather(1, used)
        record = getattr(self.state, "record", None)
        if record is not None:
            record.add(self.layer, self.logits, own, used, routes, self.valid)
        return values, used


def attach_routing(model: torch.nn.Module, gpt: torch.nn.Module) -> None:
    """Make ``gpt``'s routers what :func:`rltrainer.models.moe.recording` records for ``model`` (a
    megatron model behind the transformers call): the model's routing state is a
    :class:`~rltrainer.models.moe.MoERouting` with no transformers routers to wrap, kept where
    :func:`~rltrainer.models.moe.moe_of` looks first; each router's :class:`RouteReplay` adds to
    its record. A dense ``gpt``: nothing."""
    from rltrainer.models import moe

    config = gpt.config
    if not config.num_moe_experts:
        return
    state = moe.MoERouting([], config.num_layers, config.num_moe_experts, config.moe_router_topk)
    moe.set_routing(model, state)
    for layer, router in routers(gpt).items():
        router.router_replay.layer, router.router_replay.state = layer, state


@contextlib.contextmanager
def replaying(gpt: torch.nn.Module, routed_experts: torch.Tensor | None, index: torch.Tensor,
              attention_mask: torch.Tensor | None, replay: bool = True) -> Iterator[None]:
    """Within it, ``gpt``'s routers take ``routed_experts [b, s, L, K]`` (aligned with the input
    ids; -1: the router's own choice) as their top-k when ``replay`` (else they compare their
    choice with them), and know the real tokens (``attention_mask [b, s]``), both moved as the
    input ids are (``index [b, s]``: each left-aligned column's source column,
    :func:`~rltrainer.strategies.megatron.models.rotate_left`)."""
    if not gpt.config.num_moe_experts:
        if routed_experts is not None:
            raise ValueError("routed_experts (routing replay) given to a dense model: it has no experts to route to")
        yield
        return
    by_layer = routers(gpt)
    b, s = index.shape
    layers, k = gpt.config.num_layers, gpt.config.moe_router_topk
    valid = None if attention_mask is None else attention_mask.gather(1, index).bool().T.reshape(-1)  # [s * b]
    rotated = None
    if routed_experts is not None:
        if routed_experts.dim() != 4 or tuple(routed_experts.shape) != (b, s, layers, k):
            raise ValueError(f"routed_experts must be [rows={b}, columns={s}, num_hidden_layers={layers}, "
                             f"num_experts_per_tok={k}] aligned with input_ids, got {tuple(routed_experts.shape)}")
        rotated = routed_experts.gather(1, index.to(routed_experts.device)[:, :, None, None].expand(-1, -1, layers, k))
    try:
        for layer, router in by_layer.items():  # the router sees tokens sequence-major: [s * b, K]
            replay_ = router.router_replay
            replay_.valid, replay_.replay = valid, replay
            if rotated is not None:
                replay_.routes = rotated[:, :, layer].transpose(0, 1).reshape(s * b, k).long()
        yield
    finally:
        for router in by_layer.values():
            router.router_replay.routes = router.router_replay.valid = None

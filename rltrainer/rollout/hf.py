"""A rollout engine on plain transformers: its own model (beside the ``single`` strategy, on the
policy's parameter storage) and its own KV-cache decode loop.

The loop is written here rather than calling ``model.generate`` so that sampling is exactly the
distribution the trainer scores (``softmax(raw_logits / temperature)``, no hidden processors such
as transformers' default ``top_k=50``) and the reported log-probs are those of that distribution.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rltrainer.lm_head import head_forward, head_logits
from rltrainer.lora import require_peft
from rltrainer.models.log_probs import token_log_probs
from rltrainer.models.moe import capturing, take_routes
from rltrainer.models.support import chunkable_head
from rltrainer.rollout.engine import (ENGINES, Generation, RolloutEngine, SamplingParams, check_sleep_level,
                                      stop_token_ids)
from rltrainer.values import check_int

log = logging.getLogger(__name__)

#: Vocabulary entries sampled at once per device, in rows x vocabulary (see :class:`HFEngine`): on
#: CPU a chunk's fp64 CDF stays under glibc's largest mmap threshold (32 MiB), 27 rows at 151,665
#: entries and 1,024 at 4,096; on CUDA 256 MiB of fp32.
SAMPLE_ELEMENTS = {"cpu": 2**22, "cuda": 2**26}

_DTYPE_ALIASES = {"bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16, "fp32": torch.float32}


@dataclass
class _Chunk:
    """The responses of one chunk of rows (at most ``max_batch_size``), on the engine's device."""

    ids: torch.Tensor  # [b, T_c] int64, pad after the end
    mask: torch.Tensor  # [b, T_c] int64
    log_probs: torch.Tensor  # [b, T_c] float32, 0 on padding
    routes: list[torch.Tensor] | None = None  # with return_routed_experts: per row [p + t, L, K] int16


@ENGINES.register("hf")
class HFEngine(RolloutEngine):
    """Generation with a transformers causal LM and a ``DynamicCache``, one token per step.

    Args:
        max_batch_size: rows (prompts x ``n``) decoded at once; larger requests run in chunks.
        dtype: dtype of the engine's model (``torch.bfloat16`` or ``"bf16"``, ...); default: the
            transformers default for ``from_config``. Log-probs match the trainer's only when both
            run the same dtype.
        compile: wrap the model's forward in ``torch.compile(dynamic=True)``.
        share_weights: in the trainer's process, beside a strategy that exports the policy's own
            parameters (``single``, no LoRA), make this model's parameters the policy's storage
            instead of a copy wherever dtype and device match (the default dtype does): the model
            is held once, as when TRL generates with the policy, and a weight sync copies nothing.
            Generation only ever reads them. ``False`` keeps a copy of its own.

    Rows that finish are dropped from the running batch (and its KV cache) once a quarter of the
    batch has finished, so long tails do not pay for finished rows. Each prompt is prefilled once
    and its cache shared by its ``n`` samples. With a plain linear LM head (llama, qwen2, qwen3, ...;
    not under ``compile``) the model returns its last hidden states; each step's logits go into one
    ``[rows, V]`` buffer kept for the ``generate`` call, and are sampled a few rows at a time
    (:data:`SAMPLE_ELEMENTS`). At a 151k vocabulary the logits, softmax and fp64 CDF of 128 rows
    are 0.4 GB a token, which glibc maps and unmaps at every step (page faults: system time);
    row chunks stay in the heap it reuses. On CPU the head's product runs in blocks of vocabulary
    rows (:func:`rltrainer.lm_head.head_logits`), and sampling without top-k / top-p takes a
    two-level inverse CDF (:func:`_sample_unfiltered`: three passes over the logits, no
    ``[rows, V]`` fp64 CDF).
    """

    def __init__(self, max_batch_size: int = 256, dtype: torch.dtype | str | None = None,
                 compile: bool = False, share_weights: bool = True) -> None:
        self.max_batch_size = check_int("max_batch_size", max_batch_size, at_least=1, owner="HFEngine",
                                        meaning="rows generated at once")
        self.dtype = _resolve_dtype(dtype)
        self.compile = compile
        if not isinstance(share_weights, bool):
            raise ValueError(f"share_weights must be True (bind to the policy's parameters in one process) or False "
                             f"(keep a copy), got {share_weights!r}")
        self.shares_weights = share_weights
        self._bound: set[int] = set()  # ids of the parameters whose storage is the policy's
        self.model: torch.nn.Module | None = None
        self.device = torch.device("cpu")
        self._forward: Any = None
        self._head: torch.nn.Linear | None = None  # set: the model returns hidden states, sampled in row chunks
        self._head_output: Any = None  # what the model does to the head's output (rltrainer.models.support)
        self._logits: torch.Tensor | None = None  # [rows, V], reused by every decode step of a generate call
        self._cache_kwarg = "cache"
        self._sleep_level = 0

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def trainer_log_probs(self) -> bool:  # type: ignore[override]
        """The trainer's log-probs (same math) unless it runs in another dtype."""
        return self.dtype is None

    def setup(self, model_config: Any, tokenizer: Any, device: torch.device | str | None = None) -> None:
        """Build a randomly initialised model from ``model_config``; weights come by ``update_weights``."""
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(model_config)
        config.use_cache = True
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        kwargs = {"dtype": self.dtype} if self.dtype is not None else {}
        with self.device:  # allocate directly on the device
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        self.model = model.to(self.device).eval().requires_grad_(False)
        if self.return_routed_experts:
            if self.compile:
                raise ValueError("HFEngine(compile=True) cannot record routed experts (return_routed_experts): its "
                                 "routers' top-k is watched in eager mode. Use compile=False.")
            with capturing(self.model):  # a model with no declared routers raises here, at setup
                pass
        self._forward = torch.compile(self.model, dynamic=True) if self.compile else self.model
        self._head, self._head_output = (None, None) if self.compile else (chunkable_head(self.model) or (None, None))
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        self.tokenizer = tokenizer
        self._sleep_level = 0
        log.debug("HFEngine: built %s on %s", type(model).__name__, self.device)

    def sleep(self, level: int = 1) -> None:
        """Level 1 frees cached allocator blocks (the KV cache); level 2 also moves weights to CPU,
        unless they are bound to the policy's storage (then they are the strategy's to place, and
        level 2 is level 1)."""
        check_sleep_level("HFEngine", level)
        if self.model is not None and level == 2 and self.device.type != "cpu" and not self._bound:
            self.model.to("cpu")
        self._sleep_level = level
        _empty_cache(self.device)

    def wake_up(self) -> None:
        if self.model is not None and self._sleep_level == 2 and self.device.type != "cpu" and not self._bound:
            self.model.to(self.device)
        self._sleep_level = 0

    def teardown(self) -> None:
        self.model = None
        self._head = None
        self._bound.clear()
        self._forward = None
        _empty_cache(self.device)

    def _require_model(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("HFEngine has no model: call setup(model_config, tokenizer) first "
                               "(or it was torn down).")
        return self.model

    # -- weights -------------------------------------------------------------------------------
    loads_adapters = True

    def enable_adapters(self, lora_config: Any) -> None:
        """Inject ``lora_config``'s adapter into the model in place (``peft.inject_adapter_in_model``):
        the base weights keep their HF names (an adapted ``X.weight`` lives at
        ``X.base_layer.weight``), the adapter arrives as ``base_model.model.X.lora_A.weight``."""
        peft = require_peft()
        model = self._require_model()
        with torch.random.fork_rng(devices=[]):  # its random init is replaced by the first sync
            peft.inject_adapter_in_model(copy.deepcopy(lora_config), model)
        model.requires_grad_(False)
        self._forward = torch.compile(model, dynamic=True) if self.compile else model
        self._head, self._head_output = (None, None) if self.compile else (chunkable_head(model) or (None, None))

    def _weight_target(self, name: str, targets: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The parameter a synced name loads into, adapters included (see :meth:`enable_adapters`)."""
        target = targets.get(name)
        if target is None and name.startswith("base_model.model."):  # an adapter, as peft saves it
            owner, _, leaf = name.removeprefix("base_model.model.").rpartition(".")
            target = targets.get(f"{owner}.default.{leaf}")
        if target is None and name.endswith(".weight"):  # an adapted layer's base weight
            target = targets.get(name.removesuffix("weight") + "base_layer.weight")
        if target is None and name.endswith(".bias"):
            target = targets.get(name.removesuffix("bias") + "base_layer.bias")
        return target

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Copy each ``(hf_name, tensor)`` into the parameter or buffer of that name (cast to the
        engine's dtype and device). Tied weights may be sent under either name."""
        model = self._require_model()
        targets: dict[str, torch.Tensor] = dict(model.named_parameters())
        targets.update(model.named_buffers())
        state: dict[str, torch.Tensor] | None = None  # built only if a tied alias shows up
        count, nbytes = 0, 0
        with torch.no_grad():
            for name, tensor in weights:
                target = self._weight_target(name, targets)
                if target is None:
                    state = state if state is not None else model.state_dict(keep_vars=True)
                    target = state.get(name)
                if target is None:
                    raise KeyError(f"HFEngine.update_weights: the model has no parameter or buffer {name!r}; "
                                   f"valid names look like {list(targets)[:4]} ({len(targets)} in all)")
                if target.shape != tensor.shape:
                    raise ValueError(f"HFEngine.update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the engine's model expects {tuple(target.shape)}")
                if id(target) in self._bound:  # never write into the policy's storage: own a copy again
                    target.data = torch.empty_like(target.data)
                    self._bound.discard(id(target))
                target.data.copy_(tensor)
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
        return {"tensors": count, "bytes": nbytes}

    def weight_tensors(self, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
        """The model's own tensors of ``names`` (delta weight sync writes the changed elements into
        them in place, :mod:`rltrainer.weights.delta`); ``None`` if one is missing or shares the
        policy's storage."""
        model = self._require_model()
        targets: dict[str, torch.Tensor] = dict(model.named_parameters())
        targets.update(model.named_buffers())
        out = {}
        state: dict[str, torch.Tensor] | None = None  # built only if a tied alias shows up
        for name in names:
            target = self._weight_target(name, targets)
            if target is None:
                state = state if state is not None else model.state_dict(keep_vars=True)
                target = state.get(name)
            if target is None or id(target) in self._bound:
                return None
            out[name] = target.data
        return out

    def bind_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Like :meth:`update_weights`, but a tensor of the parameter's dtype, device and shape
        becomes its storage (``param.data = tensor``: tied parameters, one object, follow) instead
        of being copied; the caller guarantees the tensors stay valid (the policy's parameters).
        Returns ``tensors``, ``bytes`` (copied), ``shared`` (bound, or already bound)."""
        model = self._require_model()
        if not self.shares_weights:
            return self.update_weights(weights)
        targets: dict[str, torch.Tensor] = dict(model.named_parameters())
        copies: list[tuple[str, torch.Tensor]] = []
        shared = 0
        with torch.no_grad():
            for name, tensor in weights:
                target = self._weight_target(name, targets)
                if (target is not None and target.shape == tensor.shape and target.dtype == tensor.dtype
                        and target.device == tensor.device and not tensor.requires_grad):
                    if target.data_ptr() != tensor.data_ptr():
                        target.data = tensor
                    self._bound.add(id(target))
                    shared += 1
                else:
                    copies.append((name, tensor))
        stats = self.update_weights(copies) if copies else {"tensors": 0, "bytes": 0}
        return {"tensors": stats["tensors"] + shared, "bytes": stats["bytes"], "shared": shared}

    # -- generation ----------------------------------------------------------------------------
    def prompt_log_probs(self, prompt: Sequence[int]) -> list[float | None]:
        self._require_model()
        ids = torch.tensor([list(prompt)], device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()  # [N-1, V]
        return [None, *token_log_probs(logits, ids[0, 1:]).cpu().tolist()]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Generation:
        self._require_model()
        if self._sleep_level == 2:
            raise RuntimeError("HFEngine is asleep at level 2 (weights on CPU): call wake_up() before generate().")
        empty = [i for i, p in enumerate(prompts) if len(p) == 0]
        if not prompts or empty:
            raise ValueError(f"HFEngine.generate needs non-empty prompts; got {len(prompts)} prompts, "
                             f"empty at indices {empty[:8]}")
        stop_ids = self._stop_token_ids(sampling)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else int(stop_ids[0])
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        owners = [i for i in range(len(prompts)) for _ in range(sampling.n)]  # row -> prompt
        start = time.perf_counter()
        with torch.inference_mode(), self._head_returns_hidden():
            chunks = [self._decode_chunk(prompts, owners[lo : lo + self.max_batch_size], sampling, stop_ids, pad_id,
                                         generator) for lo in range(0, len(owners), self.max_batch_size)]
        T = max(c.ids.shape[1] for c in chunks)
        ids = torch.cat([F.pad(c.ids, (0, T - c.ids.shape[1]), value=pad_id) for c in chunks]).cpu()  # [R, T]
        mask = torch.cat([F.pad(c.mask, (0, T - c.mask.shape[1])) for c in chunks]).cpu()  # [R, T]
        log_probs = torch.cat([F.pad(c.log_probs, (0, T - c.log_probs.shape[1])) for c in chunks]).cpu()
        elapsed = time.perf_counter() - start
        lengths = mask.sum(1).tolist()
        responses = [row[:n] for row, n in zip(ids.tolist(), lengths)]
        stops = set(stop_ids.tolist())
        finish_reason = ["stop" if r and r[-1] in stops else "length" for r in responses]
        gen_tokens = int(sum(lengths))
        routes = None
        if self.return_routed_experts:  # each row's prompt and response tokens
            routes = [r[: len(prompts[owner]) + n].cpu() for r, owner, n in
                      zip((r for c in chunks for r in c.routes), owners, lengths)]
        return Generation(
            routed_experts=routes,
            response_ids=ids,
            response_mask=mask,
            log_probs=log_probs,
            text=self.tokenizer.batch_decode(responses, skip_special_tokens=True),
            finish_reason=finish_reason,
            metrics={"gen_tokens": gen_tokens, "gen_time_s": elapsed,
                     "tokens_per_s": gen_tokens / max(elapsed, 1e-9)},
        )

    @contextlib.contextmanager
    def _head_returns_hidden(self) -> Any:
        """Inside it the model's "logits" are its last hidden states (the head is applied in
        :meth:`_sample`, a few rows at a time); a no-op without a chunkable head."""
        if self._head is None:
            yield
            return
        try:
            with head_forward(self._head, _identity), self._head_output.returned_as_is(self.model):
                yield
        finally:
            self._logits = None

    def _sample(self, out: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and log-probs from the model's output ``[b, V]`` logits, or ``[b, H]`` hidden
        states with a chunkable head (logits made and sampled in row chunks; the same uniforms)."""
        u = None if sampling.temperature == 0 else torch.rand((len(out), 1), generator=generator, device=out.device,
                                                               dtype=torch.float64)
        if self._head is None:
            return _sample(out, sampling, u)
        weight = self._head.weight
        b, V = len(out), weight.shape[0]
        if self._logits is None or self._logits.shape[0] < b or self._logits.dtype != out.dtype:
            self._logits = out.new_empty((b, V))  # kept through the generate call: one mapping, not one a token
        logits = head_logits(out, weight, self._logits[:b])  # the head is read once a token
        logits = self._head_output.apply(logits)  # what the model does to it (a factor, a soft-cap)
        rows = max(1, SAMPLE_ELEMENTS.get(out.device.type, SAMPLE_ELEMENTS["cuda"]) // V)
        parts = [_sample(logits[lo : lo + rows], sampling, None if u is None else u[lo : lo + rows])
                 for lo in range(0, b, rows)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([t for t, _ in parts]), torch.cat([lp for _, lp in parts])

    def _stop_token_ids(self, sampling: SamplingParams) -> torch.Tensor:
        return torch.tensor(stop_token_ids(sampling, self.tokenizer), dtype=torch.long, device=self.device)

    def _decode_chunk(self, prompts: Sequence[Sequence[int]], owners: list[int], sampling: SamplingParams,
                      stop_ids: torch.Tensor, pad_id: int, generator: torch.Generator | None) -> _Chunk:
        """Decode the rows ``owners`` (prompt index per row; samples of one prompt adjacent)."""
        with capturing(self._require_model()) if self.return_routed_experts else contextlib.nullcontext() as routing:
            return self._decode(prompts, owners, sampling, stop_ids, pad_id, generator, routing)

    def _decode(self, prompts: Sequence[Sequence[int]], owners: list[int], sampling: SamplingParams,
                stop_ids: torch.Tensor, pad_id: int, generator: torch.Generator | None, routing: Any) -> _Chunk:
        b, max_new = len(owners), sampling.max_new_tokens
        # [b, V], cache, [b, P]; with routing, the prompts' routes [b, P, L, K] (left-padded)
        logits, cache, attention_mask, prompt_routes = self._prefill(prompts, owners, pad_id, max_new, routing)
        routes = None
        if routing is not None:  # then one column a decode step
            routes = torch.full((b, max_new, routing.layers, routing.top_k), -1, dtype=torch.int16, device=self.device)
        positions = attention_mask.sum(-1)  # [b] position of the next token
        out_ids = torch.full((b, max_new), pad_id, dtype=torch.long, device=self.device)
        out_mask = torch.zeros((b, max_new), dtype=torch.long, device=self.device)
        out_logp = torch.zeros((b, max_new), dtype=torch.float32, device=self.device)
        live = torch.arange(b, device=self.device)  # chunk row of each running row
        done = torch.zeros(b, dtype=torch.bool, device=self.device)  # [b_run]
        for step in range(max_new):
            tokens, logp = self._sample(logits, sampling, generator)  # [b_run], [b_run]
            alive = ~done
            out_ids[live, step] = torch.where(alive, tokens, pad_id)
            out_mask[live, step] = alive.long()
            out_logp[live, step] = torch.where(alive, logp, 0.0)
            done = done | torch.isin(tokens, stop_ids)
            n_done = int(done.sum())
            if n_done == len(done) or step + 1 == max_new:
                break
            if 4 * n_done >= len(done):  # drop finished rows from the batch and the cache
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                live, done, tokens = live[keep], done[keep], tokens[keep]
                attention_mask, positions = attention_mask[keep], positions[keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(live), 1)], dim=1)
            logits = self._forward(input_ids=tokens[:, None], attention_mask=attention_mask,
                                   position_ids=positions[:, None], use_cache=True,
                                   **{self._cache_kwarg: cache}).logits[:, -1]
            if routes is not None:  # the routes of the tokens just sampled (response column `step`)
                routes[live, step] = take_routes(routing, len(live), self.device)
            positions = positions + 1
        T = step + 1
        rows = None
        if routes is not None:
            rows = [torch.cat([p, r]) for p, r in zip(prompt_routes, routes[:, :T])]  # [P + T, L, K], left-padded
            rows = [r[len(r) - T - len(prompts[o]) :] for r, o in zip(rows, owners)]  # from the prompt's first token
        return _Chunk(out_ids[:, :T], out_mask[:, :T], out_logp[:, :T], rows)

    def _prefill(self, prompts: Sequence[Sequence[int]], owners: list[int], pad_id: int, max_new_tokens: int,
                 routing: Any = None) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor | None]:
        """Run each distinct prompt once (left-padded), then share its cache with its samples; with
        ``routing`` (:func:`~rltrainer.models.moe.capturing`), also each row's prompt routes."""
        unique, inverse = torch.unique_consecutive(torch.tensor(owners), return_inverse=True)
        rows = [prompts[i] for i in unique.tolist()]
        P = max(len(p) for p in rows)
        input_ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), P), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, P - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[i, P - len(ids):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        cache = _preallocated_cache(self._require_model().config, capacity=P + max_new_tokens)
        logits = self._forward(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
                               use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache}).logits[:, -1]  # [u, V]
        routes = None
        if routing is not None:
            routes = take_routes(routing, input_ids.numel(), self.device).unflatten(0, input_ids.shape)  # [u, P, L, K]
        if len(rows) < len(owners):
            inverse = inverse.to(self.device)
            cache.batch_select_indices(inverse)
            logits, attention_mask = logits[inverse], attention_mask[inverse]
            routes = None if routes is None else routes[inverse]
        return logits, cache, attention_mask, routes


def _preallocated_cache(config: Any, capacity: int) -> Any:
    """A ``DynamicCache`` whose full-attention layers write into buffers of ``capacity`` positions
    instead of concatenating (``torch.cat`` copies the whole cache at every step)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    layer_class = _preallocated_layer_class()
    cache.layers = [layer_class(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@functools.cache
def _preallocated_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """``keys`` / ``values`` are views of the first ``n`` positions of larger buffers."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:  # the prefill: DynamicLayer sets itself up
                return super().update(key_states, value_states, *args, **kwargs)
            assert self.keys is not None and self.values is not None
            n, t = self.get_seq_length(), key_states.shape[-2]
            # a new buffer on the first decode step, after rows were selected (new tensors), or when full
            if self.buffers is None or self.keys.data_ptr() != self.buffers[0].data_ptr() or n + t > self.capacity:
                if n + t > self.capacity:
                    self.capacity = 2 * (n + t)
                self.buffers = (_grown(self.keys, key_states, n, self.capacity),
                                _grown(self.values, value_states, n, self.capacity))
            keys, values = self.buffers
            keys[..., n : n + t, :] = key_states
            values[..., n : n + t, :] = value_states
            self.keys, self.values = keys[..., : n + t, :], values[..., : n + t, :]
            return self.keys, self.values

    return PreallocatedLayer


def _grown(old: torch.Tensor, new: torch.Tensor, n: int, capacity: int) -> torch.Tensor:
    """A ``[b, h, capacity, d]`` buffer like ``new`` holding the first ``n`` positions of ``old``."""
    buffer = new.new_empty((*new.shape[:-2], capacity, new.shape[-1]))
    if n:
        buffer[..., :n, :] = old
    return buffer


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _sample(logits: torch.Tensor, sampling: SamplingParams,
            u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row from raw ``logits [b, V]``, and its log-prob under
    ``softmax(logits / temperature)`` (before top-k / top-p; temperature 1 when greedy); ``u [b, 1]``
    float64 uniforms in [0, 1), one a row (``None`` when greedy)."""
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, token_log_probs(logits, tokens)
    scaled = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    if not 0 < sampling.top_k < logits.shape[-1] and not 0 < sampling.top_p < 1:
        return _sample_unfiltered(scaled, u)
    filtered = _filter_top_k_top_p(scaled, sampling.top_k, sampling.top_p)
    # inverse CDF: one uniform per row (b x V exponentials, as in multinomial, are slow on CPU); the
    # float64 cumsum keeps each token's interval exact to ~1e-16, so tail tokens keep their probability
    cdf = torch.softmax(filtered, dim=-1).cumsum(-1, dtype=torch.float64)  # [b, V]
    u = u * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[-1] - 1)
    return tokens, token_log_probs(scaled, tokens)


#: Vocabulary entries per block of :func:`_sample_unfiltered`'s two-level inverse CDF.
SAMPLE_BLOCK = 1024


def _sample_unfiltered(scaled: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_sample` without top-k / top-p, in three passes over ``scaled [b, V]`` (fp32): the
    maximum, ``e = exp(z - max)``, and ``e``'s sums over blocks of :data:`SAMPLE_BLOCK` entries in
    fp64. The uniform picks a block on the blocks' cumulative sums, then a token on that block's
    own (fp64, as the one-level CDF: a tail token keeps its probability); its log-prob is
    ``z - max - log(sum e)``. No ``[b, V]`` CDF, and no second softmax for the log-prob."""
    b, V = scaled.shape
    B = SAMPLE_BLOCK
    full, n_blocks = V // B, -(-V // B)
    top = scaled.amax(-1, keepdim=True)  # [b, 1]
    e = (scaled - top).exp_()  # [b, V]
    sums = torch.empty((b, n_blocks), dtype=torch.float64, device=e.device)
    if full:
        sums[:, :full] = e[:, : full * B].unflatten(1, (full, B)).sum(-1, dtype=torch.float64)
    if n_blocks > full:
        sums[:, full] = e[:, full * B :].sum(-1, dtype=torch.float64)
    cum = sums.cumsum(-1)  # [b, n_blocks]
    total = cum[:, -1:]
    target = u * total  # [b, 1]
    block = torch.searchsorted(cum, target, right=True).clamp_(max=n_blocks - 1)  # [b, 1]
    before = torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0)), 0.0)
    cols = block * B + torch.arange(B, device=e.device)  # [b, B]
    inside = e.gather(1, cols.clamp(max=V - 1)).masked_fill_(cols >= V, 0.0).cumsum(-1, dtype=torch.float64)
    j = torch.searchsorted(inside, target - before, right=True)
    last = (inside < inside[:, -1:]).sum(-1, keepdim=True)  # the block's last token of probability > 0
    tokens = (block * B + torch.minimum(j, last)).squeeze(1)  # [b]
    log_probs = scaled.gather(1, tokens[:, None]).squeeze(1) - top.squeeze(1) - total.squeeze(1).log().float()
    return tokens, log_probs


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the ``top_k`` largest, and outside the smallest set holding ``top_p`` of
    the probability mass, to ``-inf``. ``top_k=0`` and ``top_p=1`` switch each filter off."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = _DTYPE_ALIASES.get(dtype, getattr(torch, dtype, None))
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; use a torch.dtype or one of {sorted(_DTYPE_ALIASES)}, "
                         "'bfloat16', 'float16', 'float32'")
    return resolved


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()

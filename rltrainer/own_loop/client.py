"""The primitives in process: a :class:`TrainingClient` (``forward_backward``, ``forward``,
``optim_step``, ``save_state``/``load_state``, ``save_weights_and_get_sampling_client``) and the
:class:`SamplingClient` it returns (``sample``, ``compute_logprobs``), shaped like Tinker's SDK.

Every call returns a :class:`concurrent.futures.Future` at once (``.result()`` waits), as the SDK's
calls do, so a loop can submit ``optim_step`` before ``forward_backward`` is done, or sample while
training. A training client runs its calls one at a time in submission order on a thread of its
own; each sampling client samples on another, so sampling overlaps training. ``*_async`` names are
the same calls (the SDK's spelling).

How a step maps onto the Strategy: ``forward_backward`` runs the forward (the Strategy's
``compute``, no gradients) for the losses and log-probs it returns, and queues the data;
``optim_step`` runs one ``train_step`` over every datum queued since the last step (gradients of
all of them summed, then AdamW). So the gradient is the one of the summed losses, on every
strategy that runs a module, at the cost of one more forward per datum than a fused call.
"""

from __future__ import annotations

import itertools
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rltrainer.data.batch import RolloutBatch, concat_rollouts
from rltrainer.lora import require_peft
from rltrainer.own_loop import wiring
from rltrainer.own_loop.data import as_datums, datums_batch, per_datum, tokens_of
from rltrainer.own_loop.losses import LOSS_INPUTS, loss_settings
from rltrainer.own_loop.module import LOGPROBS_STAGE, PrimitivesModule, summed_loss
from rltrainer.rollout.engine import SamplingParams as EngineSampling
from rltrainer.rollout.hf import HFEngine

CustomLoss = Callable[[list[Any], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class AdamParams:
    """Tinker's ``AdamParams`` (same names and defaults); ``grad_clip_norm=0``: no clipping.
    ``weight_decay`` is AdamW's decoupled one (torch's: times the learning rate)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class SamplingParams:
    """Tinker's ``SamplingParams``: ``stop=None`` stops at EOS, ``[]`` never, a list of token ids at
    those (strings that are one token of the tokenizer too); ``top_k=-1`` is off."""

    max_tokens: int | None = None
    seed: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: Any = None


@dataclass
class ForwardBackwardOutput:
    """Per datum ``{"logprobs": [N]}`` (the target tokens' log-probs), and ``metrics`` (``loss:sum``)."""

    loss_fn_outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]
    loss_fn_output_type: str = "ArrayRecord"


@dataclass
class OptimStepResponse:
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]


class TrainingClient:
    """Tinker's training calls on a Strategy (``"single"``, ``"fsdp2"``, ``"megatron"`` or an
    instance) and a causal LM (``model``: hub id, path, ``PretrainedConfig`` or callable; ``lora``: a
    ``peft.LoraConfig``, or ``rank`` for one on all linear layers; neither: full-parameter; megatron
    trains full-parameter only). ``tokenizer``: the model's
    (for sampling); ``rollout``: where sampling clients sample, as ``Trainer(rollout=...)`` takes it:
    a :class:`~rltrainer.rollout.rollout.Rollout` (``Rollout("vllm", placement="split", delta=True)``),
    an engine or an engine name (default ``HFEngine(share_weights=False)``, colocated: a weight copy
    of its own, so an optimizer step does not reach the sampler before a push); ``root``: where
    ``save_state`` writes (default a temporary folder)."""

    def __init__(self, model: Any, tokenizer: Any = None, *, strategy: Any = "single", lora: Any = None,
                 rank: int | None = None, seed: int = 0, rollout: Any = None, root: str | Path | None = None,
                 **strategy_kwargs: Any) -> None:
        if rank is not None:
            if lora is not None:
                raise ValueError("Give lora=peft.LoraConfig(...) or rank=, not both")
            lora = require_peft().LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear")
        self.module = PrimitivesModule(model, lora=lora, seed=seed)
        self.tokenizer = tokenizer
        self.strategy = wiring.make_strategy(strategy, **strategy_kwargs)
        wiring.setup(self.strategy, self.module, seed)
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="rltrainer-own-loop-"))
        self._rollout = rollout
        self._sync: Any = None
        self._placed: Any = None  # the Rollout connect placed (to release its replicas on close)
        self.sync_metrics: dict[str, float] = {}  # the last push's (``sync/...``, as the Trainer logs them)
        self.engine_lock = threading.Lock()  # a push and a generate never overlap
        self._queue: list[RolloutBatch] = []  # datums since the last optim_step
        self._states: dict[str, dict[str, Any]] = {}  # saved name -> the strategy's small state
        self.step = 0  # optimizer steps taken
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rltrainer-train")

    def close(self) -> None:
        """Finish the calls in flight, then release the strategy's processes and the engine."""
        self._executor.shutdown(wait=True)
        try:
            if self._sync is not None:
                wiring.teardown_engine(self._placed, self._sync)
                self._sync = None
        finally:
            wiring.teardown(self.strategy)

    def __enter__(self) -> TrainingClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def is_lora(self) -> bool:
        return self.module.lora is not None

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._executor.submit(fn, *args)

    # -- training -------------------------------------------------------------------------------
    def forward_backward(self, data: Any, loss_fn: str | CustomLoss, loss_fn_config: dict[str, float] | None = None
                         ) -> Future:
        """Losses and log-probs of ``data`` (datums or a dict of ``[n, N]`` tensors) under ``loss_fn``
        (a Tinker loss name, or a callable ``(data, logprobs_list) -> (loss, metrics)``: the SDK's
        ``forward_backward_custom``); their gradients count at the next :meth:`optim_step`."""
        if callable(loss_fn):
            return self._submit(self._custom, as_datums(data), loss_fn)
        return self._submit(self._forward, as_datums(data), loss_fn, loss_fn_config, True)

    def forward_backward_custom(self, data: Any, loss_fn: CustomLoss) -> Future:
        return self.forward_backward(data, loss_fn)

    def forward(self, data: Any, loss_fn: str = "cross_entropy", loss_fn_config: dict[str, float] | None = None
                ) -> Future:
        """As :meth:`forward_backward`, without gradients."""
        return self._submit(self._forward, as_datums(data), loss_fn, loss_fn_config, False)

    def optim_step(self, adam_params: AdamParams | None = None) -> Future:
        """One AdamW step over the gradients of every ``forward_backward`` since the last step, with
        ``adam_params``' hyperparameters and clip (they may change from step to step)."""
        return self._submit(self._optim_step, adam_params or AdamParams())

    forward_backward_async, forward_async, optim_step_async = forward_backward, forward, optim_step

    def _batch(self, datums: list[Any], loss_fn: str, config: dict[str, float] | None) -> RolloutBatch:
        settings = loss_settings(loss_fn, config)
        for i, d in enumerate(datums):
            missing = [k for k in LOSS_INPUTS[loss_fn] if k != "weights" and k not in d.loss_fn_inputs]
            if missing:
                raise ValueError(f"loss_fn {loss_fn!r} needs loss_fn_inputs {['target_tokens', *LOSS_INPUTS[loss_fn]]}; "
                                 f"data[{i}] lacks {missing} (has {sorted(d.loss_fn_inputs)})")
        return datums_batch(datums, loss_fn, settings)

    def _forward(self, datums: list[Any], loss_fn: str, config: dict[str, float] | None,
                 backward: bool) -> ForwardBackwardOutput:
        batch = self._batch(datums, loss_fn, config)
        log_probs = wiring.compute(self.strategy, batch, LOGPROBS_STAGE)["logprobs"]  # [n, T]
        loss = summed_loss(log_probs, batch)
        if backward:
            self._queue.append(batch)
        return ForwardBackwardOutput([{"logprobs": lp} for lp in per_datum(log_probs, batch)],
                                     {"loss:sum": float(loss)})

    def _custom(self, datums: list[Any], loss_fn: CustomLoss) -> ForwardBackwardOutput:
        """The SDK's recipe (``training_client.py:645-725``): the forward's log-probs as leaves, the
        user's loss on them, then ``cross_entropy`` with ``weights = -dLoss/dlogprobs``."""
        forward = self._forward(datums, "cross_entropy", None, False)
        leaves = [out["logprobs"].clone().requires_grad_(True) for out in forward.loss_fn_outputs]
        loss, metrics = loss_fn(datums, leaves)
        loss.backward()
        weighted = [type(d)(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"],
                                            "weights": -leaf.grad}) for d, leaf in zip(datums, leaves)]
        surrogate = self._forward(weighted, "cross_entropy", None, True)
        return ForwardBackwardOutput(forward.loss_fn_outputs, {**{k: float(v) for k, v in metrics.items()},
                                                                "loss:sum": float(loss),
                                                                "surrogate_loss:sum": surrogate.metrics["loss:sum"]})

    def _optim_step(self, adam: AdamParams) -> OptimStepResponse:
        if not self._queue:
            raise RuntimeError("optim_step() without a forward_backward() since the last step: no gradients to apply")
        batch = concat_rollouts(self._queue, pad_token_id=0)
        self._queue = []
        metrics = wiring.train_step(self.strategy, batch, adam)
        self.step += 1
        return OptimStepResponse({"loss:sum": float(metrics["loss:sum"]), "grad_norm:mean": float(metrics["actor/grad_norm"]),
                                  "optim/step:max": float(self.step)})

    # -- state ----------------------------------------------------------------------------------
    def save_state(self, name: str) -> Future:
        """Weights and optimizer into ``root/weights/<name>``; the future gives that path."""
        return self._submit(self._save_state, name)

    def load_state(self, path: str | Path) -> Future:
        """Weights from a :meth:`save_state` path; the optimizer starts afresh."""
        return self._submit(self._load_state, Path(path), False)

    def load_state_with_optimizer(self, path: str | Path) -> Future:
        return self._submit(self._load_state, Path(path), True)

    save_state_async, load_state_async = save_state, load_state

    def _save_state(self, name: str) -> str:
        if not name or "/" in name:
            raise ValueError(f"save_state needs a name without '/', got {name!r}")
        directory = self.root / "weights" / name
        if directory.exists():
            raise FileExistsError(f"A state named {name!r} exists at {directory}; pick another name")
        self._states[str(directory)] = wiring.save_state(self.strategy, directory)
        torch.save(self._states[str(directory)], directory / "own_loop_state.pt")
        return str(directory)

    def _load_state(self, directory: Path, optimizer: bool) -> str:
        if not (directory / "own_loop_state.pt").exists():
            raise FileNotFoundError(f"{directory} is not a state saved by save_state (no own_loop_state.pt)")
        self._queue = []
        wiring.load_state(self.strategy, directory, torch.load(directory / "own_loop_state.pt"), optimizer)
        return str(directory)

    # -- sampling -------------------------------------------------------------------------------
    def save_weights_and_get_sampling_client(self, name: str | None = None) -> Future:
        """Push the current weights into the engine (built and connected on the first call) and
        return a :class:`SamplingClient` over them."""
        return self._submit(self._sampling_client)

    save_weights_and_get_sampling_client_async = save_weights_and_get_sampling_client

    def _sampling_client(self) -> SamplingClient:
        if self.tokenizer is None:
            raise ValueError("Sampling needs the model's tokenizer: TrainingClient(model, tokenizer, ...)")
        with self.engine_lock:
            if self._sync is None:
                rollout = self._rollout if self._rollout is not None else HFEngine(share_weights=False)
                self._placed, self._sync = wiring.connect(self.strategy, rollout, self.tokenizer)
            self.sync_metrics = wiring.push(self._sync, self.step)
        return SamplingClient(self, self.step)


class StaleSamplerError(RuntimeError):
    """A sampling client's weights are no longer in the engine: a later push replaced them."""


class SamplingClient:
    """Samples from the weights ``save_weights_and_get_sampling_client`` pushed: the policy after
    ``version`` optimizer steps.

    A snapshot, as in Tinker, as long as the engine holds it: the engine holds one set of weights,
    the latest push's, so once a later ``save_weights_and_get_sampling_client`` pushes newer ones
    (or, with an engine bound to the policy's parameters, ``HFEngine(share_weights=True)``, once an
    ``optim_step`` moves them), ``sample`` and ``compute_logprobs`` on this client raise
    :class:`StaleSamplerError` rather than answer from weights it was not made for (off-policy data
    labelled on-policy). Keeping every version's weights to sample them later would cost a copy of
    the model per client; take a new client after each push instead. A call submitted before the
    later push and run after it raises too: the check runs with the engine held."""

    _ids = itertools.count()

    def __init__(self, trainer: TrainingClient, version: int) -> None:
        self.trainer, self.version = trainer, version
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rltrainer-sample-{next(self._ids)}")

    def sample(self, prompt: Any, num_samples: int = 1, sampling_params: Any = None) -> Future:
        """``num_samples`` completions of ``prompt`` (token ids, or the SDK's ``ModelInput``) with
        their tokens' log-probs; a :class:`SampleResponse`."""
        return self._executor.submit(self._sample, tokens_of(prompt), num_samples, sampling_params or SamplingParams())

    def compute_logprobs(self, prompt: Any) -> Future:
        """Each prompt token's log-prob given the ones before it (``None`` for the first)."""
        return self._executor.submit(self._logprobs, tokens_of(prompt))

    sample_async, compute_logprobs_async = sample, compute_logprobs

    def _sample(self, prompt: list[int], n: int, params: Any) -> SampleResponse:
        stop_ids, stop_strings = self._stops(params.stop)
        sampling = EngineSampling(n=n, max_new_tokens=getattr(params, "max_tokens", None) or 256,
                                  temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
                                  stop_token_ids=stop_ids, seed=params.seed)
        with self.trainer.engine_lock:
            self._check_current()
            out = wiring.generate(self.trainer._sync, [prompt], sampling)
        lengths = out.response_mask.sum(1).tolist()
        return SampleResponse([self._cut(SampledSequence(out.response_ids[i, :k].tolist(), out.log_probs[i, :k].tolist(),
                                                         out.finish_reason[i]), stop_strings)
                               for i, k in enumerate(map(int, lengths))])

    def _cut(self, sequence: SampledSequence, stop_strings: list[str]) -> SampledSequence:
        """``sequence`` up to and with the token that completes the first stop string (a string of
        several tokens, which the engine cannot stop at: it samples on, and the rest is dropped; the
        kept log-probs are unchanged, each depends only on the tokens before it)."""
        decode = self.trainer.tokenizer.decode
        if not stop_strings or not any(s in decode(sequence.tokens) for s in stop_strings):
            return sequence
        k = next(k for k in range(1, len(sequence.tokens) + 1)
                 if any(s in decode(sequence.tokens[:k]) for s in stop_strings))
        return SampledSequence(sequence.tokens[:k], sequence.logprobs[:k], "stop")

    def _logprobs(self, prompt: list[int]) -> list[float | None]:
        with self.trainer.engine_lock:
            self._check_current()
            return wiring.prompt_logprobs(self.trainer._sync, prompt)

    def _check_current(self) -> None:
        held = wiring.engine_version(self.trainer._sync, self.trainer.step)
        if held != self.version:
            raise StaleSamplerError(f"This sampling client was made for the weights after {self.version} optimizer "
                                    f"steps, but the engine now holds those after {held}: it holds one version, the "
                                    "latest push's. Sample with the client the latest "
                                    "save_weights_and_get_sampling_client() returned.")

    def _stops(self, stop: Any) -> tuple[list[int] | None, list[str]]:
        """``stop`` as the token ids the engine stops at (``None``: EOS) and the strings of several
        tokens that :meth:`_cut` cuts at."""
        if stop is None:
            return None, []
        ids, strings = [], []
        for s in [stop] if isinstance(stop, (str, int)) else stop:
            if isinstance(s, str):
                if not s:
                    raise ValueError("an empty stop string stops nothing: give text or token ids")
                encoded = self.trainer.tokenizer.encode(s, add_special_tokens=False)
                if len(encoded) != 1:
                    strings.append(s)
                    continue
                s = encoded[0]
            ids.append(int(s))
        return ids, strings

"""``rollout="vllm"``: generation with vLLM (written against vLLM 0.33; GPU only, imported lazily).

Colocated (hybrid) mode, as TRL and verl run it: an in-process ``vllm.LLM`` in every rollout
process. Inside a torch.distributed group (the FSDP2 workers) it uses vLLM's
``external_launcher`` executor, so the group's ranks are vLLM's ranks and a tensor-parallel
vLLM spans ``tensor_parallel_size`` of them; alone it runs vLLM's in-process executor. In both,
vLLM's V1 multiprocessing is off, so the model lives in this process and weights load with the
model's own ``load_weights`` (which re-shards for tensor parallelism), then the prefix cache is
reset. ``sleep(level)`` / ``wake_up()`` map onto ``LLM.sleep`` / ``LLM.wake_up`` (weights first,
then the KV cache; vLLM's allocator empties this process's CUDA cache before it maps memory
back, so a colocated trainer's cached blocks are free), as in vLLM's sleep mode. Level 1 keeps a
CPU copy of the weights; level 2 discards them (only buffers are kept), so it sets
``weights_discarded`` and the next sync sends every weight.

Sampling: each prompt gets its own ``SamplingParams`` so that a seed differs per prompt (vLLM
gives a request's ``n`` samples ``seed + j``; one shared seed would give equal prompts equal
samples). Greedy with ``n > 1``, which vLLM refuses, is one greedy sample per prompt, repeated.

The engine starts from random weights (``load_format="dummy"``) built from the policy's config:
the real weights arrive through :meth:`VLLMEngine.update_weights`, like every engine's.

Log-probs come with ``logprobs_mode="processed_logprobs"``: after temperature, so that they equal
the ``hf`` engine's ``log softmax(logits / temperature)`` when top-k / top-p are off (with them
on, vLLM renormalises over the kept tokens).

Split placement (vLLM on GPUs of its own; ``weight_transport="broadcast"``, which ``"auto"``
picks there) needs nothing of the engine: :mod:`rltrainer.weights` joins the rollout worker,
which holds the model in its own process, to trainer rank 0's NCCL group, receives each bucket
into one CUDA buffer and loads views of it with :meth:`VLLMEngine.update_weights`. vLLM's own
weight-transfer engine (``weight_transfer_config={"backend": "nccl"}``) is not used: it needs
vLLM on the trainer and drives whole-model rounds of its own, where ours sends only the changed
tensors, bucket by bucket, and runs (and is tested) on gloo as well.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rltrainer.rollout.adapters import AdapterFiles, LoadsAdaptersFromDisk
from rltrainer.rollout.engine import (ENGINES, Generation, RolloutEngine, SamplingParams, check_sleep_level,
                                      gpu_engine_files, missing_engine, stop_token_ids)


#: vLLM's temperature range: it raises ``0 < T < 0.01`` to 0.01 with a warning (``_MAX_TEMP``) and
#: refuses ``T > 2`` (``SamplingParams.__post_init__`` / ``_verify_args``, vllm/sampling_params.py).
VLLM_MIN_TEMPERATURE, VLLM_MAX_TEMPERATURE = 0.01, 2.0


def check_vllm_temperature(temperature: float) -> None:
    """Refuse a temperature vLLM would change (sampling and reporting log-probs at 0.01 instead of
    the trainer's temperature) or reject deep inside ``generate``."""
    if 0 < temperature < VLLM_MIN_TEMPERATURE or temperature > VLLM_MAX_TEMPERATURE:
        raise ValueError(
            f"rollout='vllm' got temperature={temperature}; vLLM samples with 0 (greedy) or a temperature in "
            f"[{VLLM_MIN_TEMPERATURE}, {VLLM_MAX_TEMPERATURE}] (it raises smaller ones to {VLLM_MIN_TEMPERATURE}, so "
            "its samples and log-probs would not be at the trainer's temperature, and refuses larger ones). Use "
            f"temperature=0 or {VLLM_MIN_TEMPERATURE} <= temperature <= {VLLM_MAX_TEMPERATURE}, or rollout='hf'.")


def vllm_sampling_params(sampling: SamplingParams, stop_token_ids: list[int], prompts: int) -> list[Any]:
    """Our :class:`SamplingParams` as vLLM's, one per prompt (same names; one log-prob per sampled
    token). With a seed, prompt ``i`` gets ``seed + i * n`` (vLLM adds ``j`` for its sample ``j``).
    ``ignore_eos`` with ``stop_token_ids``: vLLM still stops at those, so the stops are exactly them."""
    check_vllm_temperature(sampling.temperature)
    from vllm import SamplingParams as VLLMSamplingParams

    return [VLLMSamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                               top_k=sampling.top_k, max_tokens=sampling.max_new_tokens,
                               seed=None if sampling.seed is None else sampling.seed + i * sampling.n,
                               stop_token_ids=stop_token_ids, ignore_eos=True, logprobs=0, detokenize=True)
            for i in range(prompts)]


def repeat_samples(generation: Generation, n: int) -> Generation:
    """Each row ``n`` times, adjacent: ``n`` greedy samples of a prompt are one sample."""
    return Generation(generation.response_ids.repeat_interleave(n, 0), generation.response_mask.repeat_interleave(n, 0),
                      generation.log_probs.repeat_interleave(n, 0), [t for t in generation.text for _ in range(n)],
                      [r for r in generation.finish_reason for _ in range(n)],
                      metrics={**generation.metrics, "gen_tokens": generation.metrics.get("gen_tokens", 0.0) * n},
                      weight_version=generation.weight_version)


def generation_from_outputs(outputs: Sequence[Any], pad_token_id: int, tokenizer: Any) -> Generation:
    """vLLM's ``RequestOutput`` list (one per prompt, ``n`` completions each) as a :class:`Generation`."""
    completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
    width = max((len(c.token_ids) for c in completions), default=0) or 1
    ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(completions), width), dtype=torch.long)
    log_probs = torch.zeros((len(completions), width), dtype=torch.float32)
    for row, c in enumerate(completions):
        tokens = list(c.token_ids)
        ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, :len(tokens)] = 1
        if c.logprobs is not None:
            log_probs[row, :len(tokens)] = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, tokens)])
    texts = [c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True)
             for c in completions]
    reasons = ["stop" if c.finish_reason == "stop" else "length" for c in completions]
    return Generation(ids, mask, log_probs, texts, reasons, metrics={"gen_tokens": float(mask.sum())})


@ENGINES.register("vllm", description="vLLM (GPU, optional extra): in-process LLM per rollout process")
class VLLMEngine(LoadsAdaptersFromDisk, RolloutEngine):
    """Args:
        tensor_parallel_size: GPUs per vLLM instance (ranks of the surrounding group).
        gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache).
        dtype: the inference weights' dtype (``"bfloat16"`` by default).
        enable_sleep_mode: free weights and KV cache while training (needs vLLM's sleep mode).
        max_model_len: longest prompt + response (default: the model config's).
        enforce_eager: no CUDA graphs (faster start, slower decode).
        enable_lora: serve a LoRA policy's adapter with vLLM's LoRA support (``enable_lora``,
            ``max_loras=1``): the base weights are synced once, then each sync brings only the
            adapter, which is written to a local directory and loaded as a new
            ``LoRARequest`` before the next generation (the previous one removed). Off: a LoRA
            policy arrives merged, like any policy.
        max_lora_rank: vLLM's ``max_lora_rank`` (at least the policy's ``r``).
        llm_kwargs: anything else for ``vllm.LLM``.
    """

    def __init__(self, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 dtype: torch.dtype | str = torch.bfloat16, enable_sleep_mode: bool = True,
                 max_model_len: int | None = None, enforce_eager: bool = False, enable_lora: bool = False,
                 max_lora_rank: int = 64, llm_kwargs: dict[str, Any] | None = None) -> None:
        self.tensor_parallel_size = tensor_parallel_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.enable_sleep_mode = enable_sleep_mode
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.llm_kwargs = dict(llm_kwargs or {})
        self.enable_lora, self.max_lora_rank = enable_lora, max_lora_rank
        self._adapter: AdapterFiles | None = None
        self._lora_request: Any = None  # the LoRARequest generation uses
        self.llm: Any = None
        self._asleep = 0
        self._weights_awake = False  # asleep, but update_weights has woken the weights
        self._model_dir: tempfile.TemporaryDirectory | None = None

    def setup(self, model_config: Any, tokenizer: Any, device: torch.device | str | None = None) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise missing_engine("vllm", "0.33") from exc
        self.tokenizer = tokenizer
        self._model_dir = gpu_engine_files("vllm", device, model_config, tokenizer)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # keep the model in this process
        kwargs: dict[str, Any] = {
            "model": self._model_dir.name, "load_format": "dummy", "dtype": str(self.dtype).removeprefix("torch."),
            "tensor_parallel_size": self.tensor_parallel_size, "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_sleep_mode": self.enable_sleep_mode, "enforce_eager": self.enforce_eager,
            "logprobs_mode": "processed_logprobs", "max_model_len": self.max_model_len,
        }
        if self.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["seed"] = torch.distributed.get_rank() // self.tensor_parallel_size
            _export_launcher_env()
        kwargs.update(self.llm_kwargs)
        self.llm = LLM(**{k: v for k, v in kwargs.items() if v is not None})

    @property
    def ranks_per_replica(self) -> int:
        return self.tensor_parallel_size  # external_launcher: one process per tensor-parallel rank

    def check_sampling(self, sampling: SamplingParams) -> None:
        check_vllm_temperature(sampling.temperature)

    def full_softmax_log_probs(self, sampling: SamplingParams) -> bool:
        """``processed_logprobs`` are taken after top-k / top-p, renormalised over the kept tokens
        (vllm/v1/sample/ops/topk_topp_sampler.py); greedy ones are of the raw logits, as the trainer's."""
        return sampling.temperature == 0 or (sampling.top_p >= 1.0 and sampling.top_k <= 0)

    def _model(self) -> Any:
        """The vLLM model in this process (``load_weights`` re-shards HF tensors for TP)."""
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Generation:
        if sampling.temperature == 0 and sampling.n > 1:  # vLLM: "n must be 1 when using greedy sampling"
            return repeat_samples(self.generate(prompts, dataclasses.replace(sampling, n=1)), sampling.n)
        self.wake_up()
        stop = stop_token_ids(sampling, self.tokenizer)
        adapter = self._current_adapter()
        lora = {"lora_request": adapter} if adapter is not None else {}
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                    vllm_sampling_params(sampling, stop, len(prompts)), use_tqdm=False, **lora)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return generation_from_outputs(outputs, pad, self.tokenizer)

    # -- LoRA: the adapter as a LoRARequest (vllm/lora/request.py; LLMEngine.add_lora / remove_lora) --
    def _current_adapter(self) -> Any:
        """The adapter to generate with: after a sync changed it, load it as a new ``LoRARequest``
        (a new ``lora_int_id``: vLLM caches adapters by id) and remove the previous one."""
        if self._adapter is None or not (self._adapter.dirty or self._lora_request is None):
            return self._lora_request
        from vllm.lora.request import LoRARequest

        previous = self._lora_request
        name, int_id, path = self._adapter.write()
        self._lora_request = LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)
        self.llm.llm_engine.add_lora(self._lora_request)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            self._adapter.forget(previous.lora_int_id)
        return self._lora_request

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        if self._asleep and not self._weights_awake:  # once per sleep, not once per bucket
            self.llm.wake_up(tags=["weights"])  # load into mapped memory, never into freed pages
            self._weights_awake = True
        count = nbytes = 0

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count, nbytes
            for name, tensor in weights:
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        base = self._adapter.split(counted()) if self._adapter is not None else counted()
        self._model().load_weights(base)  # the adapter's tensors stay in self._adapter
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        return {"tensors": count, "bytes": nbytes}

    def sleep(self, level: int = 1) -> None:
        check_sleep_level("VLLMEngine", level)
        if self.enable_sleep_mode and self.llm is not None and not self._asleep:
            self.llm.sleep(level=level)
            self._asleep, self._weights_awake = level, False
            if level == 2:
                self.weights_discarded = True  # vLLM kept only the buffers: the next sync sends every weight

    def wake_up(self) -> None:
        if self._asleep and self.llm is not None:
            self.llm.wake_up()
            self._asleep = 0

    def teardown(self) -> None:
        self.llm = None
        if self._adapter is not None:
            self._adapter.cleanup()
            self._adapter = self._lora_request = None
        if self._model_dir is not None:
            self._model_dir.cleanup()
            self._model_dir = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _export_launcher_env() -> None:
    """vLLM's ``external_launcher`` reads torchrun's variables; set them from the live group."""
    import torch.distributed as dist

    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available() else 0))

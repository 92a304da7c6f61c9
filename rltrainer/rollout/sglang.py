"""``rollout="sglang"``: generation with SGLang's offline ``Engine`` (written against sglang
0.5.23; GPU only, imported lazily).

The engine starts from random weights (``load_format="dummy"``) built from the policy's config.
Every weight update runs inside one ``begin_weight_update()`` / ``end_weight_update()`` session
(SGLang 0.5.23 refuses updates outside one), and every control call's ``(success, message)`` is
checked. Colocated, weights arrive through :meth:`SGLangEngine.update_weights`, bucket by
bucket, with ``Engine.update_weights_from_tensor`` (the tensors reach SGLang's scheduler
processes through CUDA IPC) and one ``flush_cache()`` after the last bucket. ``sleep`` /
``wake_up`` are ``release_memory_occupation`` / ``resume_memory_occupation`` (needs
``enable_memory_saver``).

Log-probs: SGLang reports ``log softmax(logits / temperature)`` of each sampled token (unless
``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set), the ``hf`` engine's definition. ``n`` samples of a
prompt are ``n`` requests of that prompt, adjacent, each with its own seed when a seed is given.

Split placement (SGLang on GPUs of its own; ``weight_transport="broadcast"``, which ``"auto"``
picks there): SGLang's own TP scheduler processes join trainer rank 0's weight-broadcast group
through ``Engine.init_weights_update_group`` (ranks ``rank_offset + tp_rank``), and each bucket is one
``Engine.update_weights_from_distributed(..., load_format="flattened_bucket")``: trainer rank 0
broadcasts the bucket's bytes end to end, in the order of ``names`` (see
:mod:`rltrainer.weights.wire`); the cache is flushed with the last bucket only.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rltrainer.rollout.engine import (ENGINES, Generation, RolloutEngine, SamplingParams, gpu_engine_files,
                                      missing_engine)
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES, bucketed, entry_nbytes


def sglang_requests(prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                    stop_token_ids: list[int]) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """One request per sample: ``input_ids`` and SGLang sampling-parameter dicts, samples of a
    prompt adjacent (our ``n`` becomes repetition, so every sample has its own seed)."""
    input_ids, params = [], []
    for i, prompt in enumerate(prompts):
        for j in range(sampling.n):
            input_ids.append(list(prompt))
            p: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                 "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                                 "max_new_tokens": sampling.max_new_tokens, "stop_token_ids": stop_token_ids,
                                 "ignore_eos": True, "skip_special_tokens": True}  # stops: exactly stop_token_ids
            if sampling.seed is not None:
                p["sampling_seed"] = sampling.seed + i * sampling.n + j
            params.append(p)
    return input_ids, params


def generation_from_sglang(outputs: Sequence[dict[str, Any]], pad_token_id: int) -> Generation:
    """SGLang's output dicts (``output_ids``, ``meta_info``) as a :class:`Generation`."""
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
        entries = out["meta_info"].get("output_token_logprobs") or []
        log_probs[row, :len(entries)] = torch.tensor([float(e[0]) for e in entries[:len(tokens)]])
        finish = out["meta_info"].get("finish_reason") or {}
        reasons.append("length" if (finish.get("type") if isinstance(finish, dict) else finish) == "length" else "stop")
    return Generation(ids, mask, log_probs, [o.get("text", "") for o in outputs], reasons,
                      metrics={"gen_tokens": float(mask.sum())})


@ENGINES.register("sglang", description="SGLang (GPU, optional extra): offline Engine per rollout process")
class SGLangEngine(RolloutEngine):
    """Args:
        tp_size: GPUs per SGLang engine.
        mem_fraction_static: share of GPU memory for weights + KV cache.
        dtype: the inference weights' dtype (``"bfloat16"`` by default).
        enable_memory_saver: allow ``sleep`` / ``wake_up`` (release / resume memory).
        bucket_bytes: size of each ``update_weights_from_tensor`` call.
        engine_kwargs: anything else for ``sglang.Engine`` (``ServerArgs`` fields).
    """

    def __init__(self, tp_size: int = 1, mem_fraction_static: float = 0.5, dtype: torch.dtype | str = torch.bfloat16,
                 enable_memory_saver: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 engine_kwargs: dict[str, Any] | None = None) -> None:
        self.tp_size, self.mem_fraction_static = tp_size, mem_fraction_static
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.enable_memory_saver, self.bucket_bytes = enable_memory_saver, bucket_bytes
        self.engine_kwargs = dict(engine_kwargs or {})
        self.engine: Any = None
        self._asleep = False
        self._model_dir: tempfile.TemporaryDirectory | None = None
        self._group_name: str | None = None  # the weight-broadcast group SGLang's schedulers joined
        self._updating = False  # a begin_weight_update() session is open

    def setup(self, model_config: Any, tokenizer: Any, device: torch.device | str | None = None) -> None:
        try:
            import sglang
        except ImportError as exc:
            raise missing_engine("sglang", "0.5.23") from exc
        self.tokenizer = tokenizer
        self._model_dir = gpu_engine_files("sglang", device, model_config, tokenizer)
        index = torch.device(device).index if device is not None and torch.device(device).index is not None else 0
        kwargs = {"model_path": self._model_dir.name, "load_format": "dummy", "tp_size": self.tp_size,
                  "mem_fraction_static": self.mem_fraction_static, "dtype": str(self.dtype).removeprefix("torch."),
                  "enable_memory_saver": self.enable_memory_saver, "base_gpu_id": index}
        kwargs.update(self.engine_kwargs)
        self.engine = sglang.Engine(**kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Generation:
        self.wake_up()
        stop = sampling.stop_token_ids if sampling.stop_token_ids is not None else [self.tokenizer.eos_token_id]
        input_ids, params = sglang_requests(prompts, sampling, stop)
        outputs = self.engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return generation_from_sglang(outputs, pad)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        self._begin_update()
        count = nbytes = 0
        for bucket in bucketed(weights, self.bucket_bytes):
            _checked(self.engine.update_weights_from_tensor(bucket, flush_cache=False), "update_weights_from_tensor")
            count += len(bucket)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
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
        """SGLang's schedulers join as ranks ``rank_offset + tp_rank`` (SGLang's own timeout applies)."""
        self.close_weight_group()
        _checked(self.engine.init_weights_update_group(master_address=address, master_port=port,
                                                       rank_offset=rank_offset, world_size=world_size,
                                                       group_name=group_name, backend=backend),
                 "init_weights_update_group")
        self._group_name = group_name

    def receive_weights(self, entries: Sequence[tuple[str, str, tuple[int, ...]]], last: bool) -> dict[str, float]:
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

    def close_weight_group(self) -> None:
        if self._group_name is not None and self.engine is not None:
            try:
                self.engine.destroy_weights_update_group(self._group_name)
            except Exception:  # the engine may be shutting down
                pass
        self._group_name = None

    def _begin_update(self) -> None:
        if not self._updating:
            self.wake_up()  # load into resumed memory
            _checked(self.engine.begin_weight_update(), "begin_weight_update")
            self._updating = True

    def _end_update(self) -> None:
        self._updating = False
        _checked(self.engine.end_weight_update(), "end_weight_update")

    def sleep(self, level: int = 1) -> None:
        if self.enable_memory_saver and self.engine is not None and not self._asleep:
            self.engine.release_memory_occupation()
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep and self.engine is not None:
            self.engine.resume_memory_occupation()
            self._asleep = False

    def teardown(self) -> None:
        if self.engine is not None:
            self.close_weight_group()
            self.engine.shutdown()
            self.engine = None
        if self._model_dir is not None:
            self._model_dir.cleanup()
            self._model_dir = None


def _checked(result: Any, call: str) -> Any:
    """SGLang's control calls answer ``(success, message)`` (or an object with ``success``): raise on
    a failure instead of letting it pass silently."""
    if hasattr(result, "success"):
        success, message = result.success, getattr(result, "message", "")
    elif isinstance(result, tuple) and len(result) == 2:
        success, message = result
    else:
        return result
    if not success:
        raise RuntimeError(f"SGLang Engine.{call}() failed: {message}")
    return result

"""The rollout engine interface: generation, weight updates, and memory release.

An engine owns its own model in its own (inference) layout. Its weights change only through a
weight sync, even in one process: the engine never shares parameter objects with the training
strategy. One exception saves a copy of the model: an engine in the trainer's process with the
same dtype and device as the policy (the ``hf`` engine beside the ``single`` strategy) may bind its
parameters to the policy's storage (:meth:`RolloutEngine.bind_weights`), as TRL generates with the
policy itself; each sync then checks the binding instead of copying. How the tensors got there (a broadcast, shared
memory, Ray's object store) is :mod:`rltrainer.weights`' business, which also sets
:attr:`RolloutEngine.weight_version` when a sync has loaded. An engine with a receiving path of
its own (SGLang's schedulers) sets ``native_weight_broadcast`` and implements the broadcast
hooks, which that layer drives.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrainer.registry import Registry
from rltrainer.values import check_float, check_int

log = logging.getLogger(__name__)

ENGINES: Registry[RolloutEngine] = Registry("rollout engine")


@dataclass
class SamplingParams:
    """How to sample. Names and meanings follow vLLM's ``SamplingParams``.

    ``temperature=0`` means greedy (its ``n`` samples of a prompt are one sample, repeated).
    ``top_k=0`` / ``top_p=1.0`` switch those filters off. Generation stops at any of
    ``stop_token_ids`` (the tokenizer's EOS by default; ``[]``: none) or after ``max_new_tokens``
    (SGLang also stops at the model's EOS whenever the list is not empty: it can stop at given
    tokens only together with EOS). Each prompt is sampled ``n`` times; samples of one prompt are
    adjacent. ``seed`` makes a request reproducible on the same engine: ``hf`` draws the request
    from one generator seeded with it; vLLM and SGLang draw sample ``j`` of prompt ``i`` with
    ``seed + i * n + j`` (SGLang only with ``enable_deterministic_inference``; it warns otherwise).
    """

    n: int = 1
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        self.n = check_int("n", self.n, at_least=1, meaning="samples per prompt: num_generations")
        self.max_new_tokens = check_int("max_new_tokens", self.max_new_tokens, at_least=1,
                                        meaning="tokens a response may have")
        self.temperature = check_float("temperature", self.temperature, at_least=0, meaning="0 is greedy")
        self.top_p = check_float("top_p", self.top_p, above=0, at_most=1, meaning="1.0 is off")
        self.top_k = check_int("top_k", self.top_k, at_least=0, meaning="0 is off")
        self.seed = check_int("seed", self.seed, none="unseeded")
        if self.stop_token_ids is not None:
            self.stop_token_ids = [check_int("stop_token_ids[]", t, at_least=0) for t in self.stop_token_ids]


@dataclass
class Generation:
    """What :meth:`RolloutEngine.generate` returns for ``R = len(prompts) * n`` samples.

    Row ``i * n + j`` is sample ``j`` of prompt ``i``.
    """

    response_ids: torch.Tensor  # [R, T] int64, right-padded with pad_token_id
    response_mask: torch.Tensor  # [R, T] int64, 1 on generated tokens (a final EOS included)
    # [R, T] float32, log p(token) under softmax(raw_logits / temperature), over the whole vocabulary
    # unless RolloutEngine.full_softmax_log_probs(sampling) says otherwise (vLLM with top-k / top-p)
    log_probs: torch.Tensor
    text: list[str]  # [R] decoded responses, special tokens skipped
    finish_reason: list[str]  # [R] "stop" (hit a stop token) or "length" (hit max_new_tokens)
    metrics: dict[str, float] = field(default_factory=dict)
    weight_version: int | None = None  # the policy version of the weights that generated it, if known
    # [R] int64, each row's version, where rows came from replicas holding different versions (then
    # weight_version is the oldest of them); None: every row's is weight_version
    row_weight_versions: torch.Tensor | None = None
    # [R] int16 tensors [p_r + t_r, L, K], with RolloutEngine.return_routed_experts on a MoE policy: the
    # experts each token of row r's prompt and response went to, per decoder layer (L: the config's
    # num_hidden_layers) and routing slot (K: num_experts_per_tok; slot order carries no meaning);
    # -1 where the engine routed nothing (a dense layer, the last sampled token it never ran). None: not recorded.
    routed_experts: list[torch.Tensor] | None = None


class RolloutEngine(abc.ABC):
    """Owns generation. Lifecycle: ``setup`` once, then ``generate`` / ``update_weights``
    alternately, with ``sleep`` / ``wake_up`` around training when memory is shared.
    """

    tokenizer: Any = None
    dtype: torch.dtype | None = None  # weights are cast to this before they are sent (None: as trained)
    weight_version: int = -1  # the version of the last weight sync fully loaded (set by rltrainer.weights)
    trainer_log_probs: bool = False  # its log-probs are the trainer's (same math and dtype), e.g. ``hf``
    # True once a sleep discarded the inference weights: the next sync must send every weight. The
    # Strategy starting that sync reads it and sets it back to False (see :meth:`sleep`).
    weights_discarded: bool = False
    #: Set before :meth:`setup` (the Trainer does when the module replays routes, see
    #: :mod:`rltrainer.models.moe`): :meth:`generate` then fills :attr:`Generation.routed_experts`
    #: for a mixture-of-experts policy. An engine that cannot record routes raises in ``setup``.
    return_routed_experts: bool = False

    @property
    def ranks_per_replica(self) -> int:
        """Worker processes one replica spans (vLLM under ``external_launcher``: its
        ``tensor_parallel_size``). Every process of a replica gets the same prompts."""
        return 1

    @abc.abstractmethod
    def setup(self, model_config: Any, tokenizer: Any, device: torch.device | str | None = None) -> None:
        """Build the inference model from a transformers config (weights arrive by ``update_weights``)."""

    # -- what a request means on this engine (checked before any model is built) ----------------
    def check_model(self, model_config: Any, device_type: str) -> None:
        """Raise a ``ValueError`` if this engine cannot run the policy of ``model_config`` on devices of
        ``device_type`` (``"cpu"``, ``"cuda"``): checked where the engine's processes are known, before it
        starts (vLLM on CPU: its attention's head sizes). Default: any model."""

    def plan_notes(self) -> list[str]:
        """Lines for the run plan (:mod:`rltrainer.plan`) on what this engine costs on this machine.
        Default: none."""
        return []

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Raise a ``ValueError`` if this engine cannot sample as ``sampling`` asks (vLLM: its
        temperature range). Default: any valid :class:`SamplingParams`."""

    def full_softmax_log_probs(self, sampling: SamplingParams) -> bool:
        """Whether :attr:`Generation.log_probs` under ``sampling`` are ``log softmax(logits /
        temperature)`` over the whole vocabulary: what the trainer's ``response_log_probs`` computes
        and what a rollout correction compares them with. ``hf`` and SGLang: always (before top-k /
        top-p); vLLM: not with top-k / top-p (renormalised over the kept tokens)."""
        return True

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Generation:
        """Sample ``sampling.n`` responses for each prompt (a list of token ids, no padding)."""

    def generate_async(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Future:
        """:meth:`generate` as a ``concurrent.futures.Future``. An engine in other processes returns
        at once (the controller trains meanwhile); this default generates now and returns it done."""
        future: Future = Future()
        try:
            future.set_result(self.generate(prompts, sampling))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def prompt_log_probs(self, prompt: Sequence[int]) -> list[float | None]:
        """Each token's log-prob under the engine's weights given the tokens before it (``None`` for
        the first): the scoring call of Tinker's ``compute_logprobs``. ``hf`` and ``vllm`` give it."""
        raise NotImplementedError(f"{type(self).__name__} does not score prompts (prompt_log_probs); the engines "
                                  "that do: 'hf', 'vllm'")

    @abc.abstractmethod
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load ``(hf_name, full_tensor)`` pairs into the inference model; return stats
        (``tensors``, ``bytes``). Tensors may be reused by the caller afterwards: copy them.

        A sync calls it once per bucket between :meth:`start_weight_update` and
        :meth:`finish_weight_update`; called outside such a pair, the call is a whole update on its own."""

    # -- one sync as one update session (optional) ------------------------------------------------
    def start_weight_update(self) -> None:
        """Before the first bucket of a sync (vLLM: ``LLM.start_weight_update``). Between this and
        :meth:`finish_weight_update` only :meth:`update_weights` is called, never ``generate``."""

    def finish_weight_update(self) -> None:
        """After the last bucket of a sync (vLLM: ``LLM.finish_weight_update``, which processes the
        layers that arrived; then the prefix cache is reset)."""

    def weight_groups(self, names: Sequence[str]) -> list[list[str]]:
        """Groups of the policy's weight ``names`` that this engine must receive together: in the
        same sync whenever one of them changed, and in the same bucket (vLLM fuses ``q/k/v_proj``
        into one ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``, and rebuilds a layer only
        from all of its tensors). Names in no group travel alone. Default: none."""
        return []

    def weight_digests(self) -> dict[str, str] | None:
        """Digests of the weights the engine holds, in its own layout and names (vLLM: its weight
        checker's SHA-256 of each parameter, per rank), to compare two replicas, or an engine fed
        deltas with one given the same weights in full; ``None`` where it has no such check (the
        default). A digest of the engine's layout cannot be computed from the policy's tensors."""
        return None

    @property
    def runtime_env(self) -> dict[str, Any] | None:
        """The Ray ``runtime_env`` of a process of its own (split placement), e.g. another Python
        environment's interpreter (``py_executable``); ``None``: the trainer's environment."""
        return None

    # -- one process: an engine that shares the policy's storage (optional) -----------------------
    #: True: :meth:`bind_weights` may be called instead of :meth:`update_weights` with tensors that
    #: stay valid (the policy's own parameters, from a strategy whose ``exports_live_parameters``).
    shares_weights: bool = False

    def bind_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Make the inference parameters *be* these tensors (same storage, no copy) where dtype,
        device and shape allow, and copy the rest; stats as :meth:`update_weights` plus ``shared``."""
        raise NotImplementedError(f"{type(self).__name__} does not share weights (shares_weights=False)")

    # -- LoRA: an engine that loads adapters (optional) --------------------------------------------
    #: True: for a LoRA policy the strategy calls :meth:`enable_adapters` after ``setup`` and syncs
    #: the base weights once (HF names), then only the adapter, in peft's saved names
    #: (``base_model.model.<module>.lora_A.weight``, see :mod:`rltrainer.lora`). False: it gets
    #: the merged weights, as any policy's.
    loads_adapters: bool = False

    def enable_adapters(self, lora_config: Any) -> None:
        """Prepare to serve a LoRA adapter of ``lora_config`` (a ``peft.LoraConfig``) on the base model."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters (loads_adapters=False)")

    def check_split_transport(self, transport: str, adapter: bool) -> None:
        """Split placement, before any replica starts: raise if this engine cannot receive syncs by
        ``transport`` (the resolved ``Rollout(transport=...)``); ``adapter``: they carry a LoRA adapter
        (:attr:`loads_adapters`). Default: every transport."""

    # -- split placement, broadcast transport: an engine's own receiving path (optional) --------
    native_weight_broadcast: bool = False  # True: the hooks below receive; else rltrainer.weights does

    @property
    def weight_group_ranks(self) -> int:
        """Ranks this engine takes in the weight-broadcast group (one per receiving process)."""
        return 1

    def init_weight_group(self, address: str, port: int, rank_offset: int, world_size: int, group_name: str,
                          backend: str, device: torch.device | str, timeout_s: float) -> None:
        """(``native_weight_broadcast`` only) Join the group whose rank 0 (trainer rank 0) hosts a
        ``TCPStore`` at ``address:port``, as ranks ``rank_offset .. rank_offset +
        weight_group_ranks - 1`` of ``world_size``. Every member joins at once."""
        raise NotImplementedError(f"{type(self).__name__} has no native weight broadcast")

    def receive_weights(self, entries: Sequence[tuple[str, str, tuple[int, ...]]], last: bool) -> dict[str, float]:
        """(``native_weight_broadcast`` only) Receive and load one broadcast bucket: ``entries``
        are ``(hf_name, dtype_name, shape)`` in wire order (:mod:`rltrainer.weights.wire`);
        ``last`` marks the sync's last bucket. Returns ``tensors`` and ``bytes``."""
        raise NotImplementedError(f"{type(self).__name__} has no native weight broadcast")

    def close_weight_group(self) -> None:
        """(``native_weight_broadcast`` only) Leave the weight-broadcast group, if in one."""

    def sleep(self, level: int = 1) -> None:
        """Release memory while training runs. Level 1: the KV cache (and CUDA graphs); the weights
        survive (vLLM, and SGLang with ``enable_weights_cpu_backup``, copy them to CPU memory; SGLang
        without it and ``hf`` keep them on the GPU). Level 2: the weights' GPU memory too; an engine
        that keeps no copy of them (vLLM; SGLang without ``enable_weights_cpu_backup``) sets
        :attr:`weights_discarded`, so the next weight sync sends every weight, frozen ones included,
        instead of only those changed since the last sync (``hf`` moves them to CPU memory)."""

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` released."""

    def teardown(self) -> None:
        """Free everything; the engine is not used again."""


def check_engine_sampling(engine: RolloutEngine, sampling: SamplingParams, rollout_correction: str | None,
                          module: str) -> None:
    """Before any model is built (``Trainer.fit``): ``engine`` can sample as ``sampling`` asks, and a
    ``rollout_correction`` (of the module named ``module``) compares like with like: its IS ratios
    divide the trainer's full-vocabulary softmax by the engine's log-probs, so an engine whose
    log-probs are renormalised by top-k / top-p is refused (the ratios would measure the filter,
    not the policy lag). Without a correction that only skews the logged ``rollout_corr/*``
    mismatch metrics: a warning."""
    engine.check_sampling(sampling)
    if engine.full_softmax_log_probs(sampling):
        return
    name = type(engine).__name__
    settings = f"top_p={sampling.top_p}, top_k={sampling.top_k}"
    if rollout_correction is not None:
        raise ValueError(
            f"{module}(rollout_correction={rollout_correction!r}) divides the trainer's log softmax(logits / "
            f"temperature) over the whole vocabulary by the engine's log-probs, and {name}'s log-probs with "
            f"{settings} are renormalised over the tokens top-k / top-p keep, so the IS ratios would measure the "
            "filter, not the policy lag. Turn the filters off (top_p=1.0, top_k=0), or the correction off "
            "(rollout_correction=None), or use an engine whose log-probs are the full softmax (rollout='hf' or "
            "'sglang').")
    log.warning("%s's log-probs with %s are renormalised over the tokens top-k / top-p keep, not the trainer's "
                "full-vocabulary softmax: the rollout_corr/* mismatch metrics include that difference (top_p=1.0, "
                "top_k=0 make them comparable; a rollout_correction would be refused).", name, settings)


def check_sleep_level(engine: str, level: int) -> None:
    if level not in (1, 2):
        raise ValueError(f"{engine}.sleep(level={level!r}): level must be 1 (KV cache) or 2 (KV cache and weights)")


def stop_token_ids(sampling: SamplingParams, tokenizer: Any) -> list[int]:
    """The tokens a request stops at: ``sampling.stop_token_ids``, else the tokenizer's EOS."""
    if sampling.stop_token_ids is not None:
        return list(sampling.stop_token_ids)  # [] means: no stop token, always max_new_tokens
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("No stop tokens: pass SamplingParams(stop_token_ids=[...]) (or [] for none), or use a "
                         "tokenizer with an EOS token.")
    return [eos] if isinstance(eos, int) else list(eos)


def free_cached_blocks() -> None:
    """Return this process's cached CUDA blocks to the driver (``torch.cuda.empty_cache()``), so that
    an engine waking up beside a trainer finds them: blocks PyTorch caches are invisible to
    another allocator (vLLM's CuMem pool) or another process (SGLang's schedulers)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def gpu_engine_files(name: str, device: torch.device | str | None, model_config: Any, tokenizer: Any,
                     devices: tuple[str, ...] = ("cuda",)) -> Any:
    """For an engine that builds its model from files (vLLM, SGLang): check the device type against
    ``devices`` and write the policy's config and tokenizer to a temporary folder (weights come by
    ``update_weights``; the engine loads random ones first). Returns the ``TemporaryDirectory``."""
    import tempfile

    if device is not None and torch.device(device).type not in devices:
        raise ValueError(f"rollout={name!r} runs on {' or '.join(devices)} devices here; this process's device is "
                         f"{device}. Use rollout='hf', which runs anywhere.")
    config = with_architectures(name, model_config)  # checked before the folder exists
    folder = tempfile.TemporaryDirectory(prefix=f"rltrainer-{name}-")
    config.save_pretrained(folder.name)
    tokenizer.save_pretrained(folder.name)
    return folder


@dataclass
class ModelFiles:
    """A policy's config and tokenizer as the files ``save_pretrained`` writes: how they reach an
    engine whose process runs another Python environment (another transformers, in which the
    trainer's pickled objects may not load)."""

    files: dict[str, bytes]

    @classmethod
    def of(cls, model_config: Any, tokenizer: Any) -> ModelFiles:
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory(prefix="rltrainer-model-files-") as folder:
            model_config.save_pretrained(Path(folder) / "config")
            tokenizer.save_pretrained(Path(folder) / "tokenizer")
            return cls({str(p.relative_to(folder)): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()})

    def load(self) -> tuple[Any, Any]:
        """``(config, tokenizer)`` built from the files by this process's transformers."""
        import tempfile
        from pathlib import Path

        from transformers import AutoConfig, AutoTokenizer

        with tempfile.TemporaryDirectory(prefix="rltrainer-model-files-") as folder:
            for name, data in self.files.items():
                (Path(folder) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(folder) / name).write_bytes(data)
            # apart: beside a config.json, AutoTokenizer would pick the model family's tokenizer class
            return AutoConfig.from_pretrained(Path(folder) / "config"), AutoTokenizer.from_pretrained(Path(folder) / "tokenizer")


def with_architectures(name: str, model_config: Any) -> Any:
    """``model_config`` with ``architectures`` set, which vLLM and SGLang read to pick the model
    class (SGLang indexes ``architectures[0]``). A config built in code has none (transformers
    fills it in when a *model* is saved); it gets its causal LM class from transformers' mapping of
    ``model_type`` (``"qwen2"`` -> ``Qwen2ForCausalLM``), on a copy: the caller's config is unchanged."""
    if getattr(model_config, "architectures", None):
        return model_config
    import copy

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(model_config, "model_type", None)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type or "")
    if cls is None:
        raise ValueError(f"rollout={name!r} picks the model class from the policy config's architectures, which is "
                         f"empty, and model_type={model_type!r} has no transformers causal LM class to fill it in. "
                         "Set config.architectures = ['<Name>ForCausalLM'] (the class the engine serves) on the "
                         "policy's config, or load the policy from a saved checkpoint (its config.json names it).")
    config = copy.deepcopy(model_config)
    config.architectures = [cls if isinstance(cls, str) else cls[0]]
    return config


def missing_engine(name: str, version: str) -> ImportError:
    return ImportError(f"rollout={name!r} needs {name}: pip install -e '.[{name}]' (GPU machines; written against "
                       f"{name} {version})")


def build_engine(engine: str | RolloutEngine, **kwargs: Any) -> RolloutEngine:
    """Resolve a name (``"hf"``, ...) through the registry, or pass an engine instance through."""
    if isinstance(engine, RolloutEngine):
        return engine
    return ENGINES.build(engine, **kwargs)

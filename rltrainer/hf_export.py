"""Hugging Face export: the trained policy as a directory ``AutoModelForCausalLM.from_pretrained``
loads (safetensors shards, ``config.json``, ``generation_config.json``, the tokenizer), from any
strategy.

The weights come from the strategy's own export, the stream weight sync uses
(``Strategy.export_weights``: full tensors in HF names, gathered one bucket at a time from FSDP2
shards or megatron's tensor x pipeline layout, converted back by
:mod:`rltrainer.strategies.megatron.layouts`). Each safetensors shard holds at most
``max_shard_bytes`` (default: the rollout's ``bucket_bytes``), so an export holds about one
bucket in memory besides the model. A LoRA policy exports merged (``lora="merged"``: plain HF
weights) or as the adapter alone (``lora="adapter"``: ``adapter_config.json`` and
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, path)`` loads).
The tensors are written in the hub's checkpoint form, as ``save_pretrained`` writes them
(:func:`to_checkpoint_form`: a mixture of experts' fused ``[E, ...]`` tensors one expert at a time;
loading that form back by parameter name: :mod:`rltrainer.models.checkpoint_form`).

The directory appears only when complete: it is written under a temporary name beside it, then
renamed. The command line that exports a checkpoint is :mod:`rltrainer.export`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from rltrainer.checkpoints import commit_directory, temporary_directory
from rltrainer.lora import adapter_weights, lora_view
from rltrainer.models.safetensors_io import write_safetensors
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES, bucketed

log = logging.getLogger(__name__)

LORA_MODES = ("merged", "adapter")


def write_shards(weights: Iterable[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int,
                 prefix: str = "model") -> dict[str, Any]:
    """Stream ``(name, tensor)`` into ``out/<prefix>-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` each (one ``<prefix>.safetensors`` if one is enough) and, for several, the
    ``<prefix>.safetensors.index.json`` from_pretrained reads. Returns the index."""
    written: list[tuple[Path, list[str]]] = []
    total = 0
    for shard in bucketed(weights, max_shard_bytes):
        path = out / f"{prefix}-part{len(written):05d}.safetensors"
        total += write_safetensors(path, shard)
        written.append((path, [name for name, _ in shard]))
    if not written:
        raise ValueError("The export yielded no tensors (an empty model, or an adapter with no LoRA weights)")
    weight_map: dict[str, str] = {}
    for i, (path, names) in enumerate(written):
        final = f"{prefix}.safetensors" if len(written) == 1 else \
            f"{prefix}-{i + 1:05d}-of-{len(written):05d}.safetensors"
        path.rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if len(written) > 1:
        (out / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


# -- the hub's checkpoint form ------------------------------------------------------------------------
def to_checkpoint_form(weights: Iterable[tuple[str, torch.Tensor]],
                       config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (in-memory names and tensors of a model built from ``config``) as its hub
    checkpoint stores them: what ``save_pretrained`` writes, one tensor (or one expert) at a time.
    A checkpoint tensor made from several in-memory ones is yielded once all of them have come."""
    try:
        from transformers.core_model_loading import WeightConverter, apply_converters, revert_weight_conversion
    except ImportError as err:  # apply_converters came in transformers 5.21 (vLLM 0.33 pins <5.21, SGLang 5.19)
        import transformers
        raise ImportError(f"The export needs transformers>=5.21 (this environment has {transformers.__version__}): "
                          "export from the trainer's own environment, not one with vLLM 0.33 or SGLang 0.5.23 "
                          "installed beside it (the GPU page's install section)") from err

    model = _meta_model(config)
    conversions = _saved_conversions(model)
    if not conversions:
        yield from weights
        return
    model._weight_conversions = conversions  # revert_weight_conversion reads them here, instead of each call
    converters = [c.reverse_transform() for c in conversions[::-1] if isinstance(c, WeightConverter)]
    waiting: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # checkpoint tensor -> its in-memory parts so far
    for name, tensor in weights:
        target, pattern = apply_converters(name, converters)
        parts = next((len(c.source_patterns) for c in converters if pattern in c.source_patterns), 1)
        if parts > 1:
            waiting.setdefault(target, {})[pattern] = (name, tensor)
            if len(waiting[target]) < parts:
                continue
            group = dict(waiting.pop(target).values())
        else:
            group = {name: tensor}
        yield from revert_weight_conversion(model, group).items()
    if waiting:
        missing = {target: sorted(parts) for target, parts in waiting.items()}
        raise ValueError(f"The export stream ended before every part of these checkpoint tensors came: {missing}")


def _meta_model(config: Any) -> torch.nn.Module:
    """The model ``config`` builds, on the meta device (its structure decides the mappings)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))


def _saved_conversions(model: torch.nn.Module) -> list[Any]:
    """The transforms ``save_pretrained`` reverts for a model not loaded by ``from_pretrained``
    (transformers' ``revert_weight_conversion``: no legacy renamings, no prefix changes)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    return [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]


# -- the directory ----------------------------------------------------------------------------------
def export_dir(path: str | Path) -> Path:
    """``path`` as a directory to export into: new, or empty (an export is never mixed with files
    already there); raises otherwise."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"save_hf: {str(path)!r} already exists and is not an empty directory. Export into a "
                              "new directory (an export never overwrites one), or delete it first.")
    return path


@contextlib.contextmanager
def staged(path: str | Path) -> Iterator[Path]:
    """Write an export into a temporary directory beside ``path`` (new or empty, see
    :func:`export_dir`) and rename it onto ``path`` once the block completes; removed on error.
    The same staging as a checkpoint's (:mod:`rltrainer.checkpoints`)."""
    path = export_dir(path)
    tmp = temporary_directory(path)
    try:
        yield tmp
        commit_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def generation_config_for(config: Any, tokenizer: Any) -> Any:
    """transformers' generation config of ``config``, with the tokenizer's EOS and pad ids where the
    model config has none."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(config)
    if tokenizer is not None:
        if generation.eos_token_id is None and getattr(tokenizer, "eos_token_id", None) is not None:
            generation.eos_token_id = tokenizer.eos_token_id
        if generation.pad_token_id is None and getattr(tokenizer, "pad_token_id", None) is not None:
            generation.pad_token_id = tokenizer.pad_token_id
    return generation


def save_pretrained_dir(weights: Iterable[tuple[str, torch.Tensor]], config: Any, path: str | Path,
                        tokenizer: Any = None, dtype: torch.dtype | None = None,
                        max_shard_bytes: int = DEFAULT_BUCKET_BYTES) -> Path:
    """Write a transformers model directory from a stream of HF-named tensors: shards, config (its
    ``dtype`` set to the weights'), generation config, tokenizer. Tied weights come once (the
    input embedding), as ``named_parameters`` gives them; ``lm_head.weight`` is dropped if the
    config ties it. The tensors are written in the hub checkpoint's form, as ``save_pretrained``
    writes them (a mixture of experts' fused tensors one expert at a time:
    :func:`to_checkpoint_form`), so vLLM, SGLang and other tools load the export."""
    with staged(path) as tmp:
        tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
        seen: list[torch.dtype] = []

        def stream() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if tied and name == "lm_head.weight":
                    continue
                if not seen:
                    seen.append(tensor.dtype)
                yield name, tensor

        write_shards(to_checkpoint_form(stream(), config), tmp, max_shard_bytes)
        config = copy.deepcopy(config)
        config.dtype = dtype or (seen[0] if seen else torch.float32)
        config.use_cache = True  # training turns the cache off; generation wants it
        config.save_pretrained(tmp)
        generation_config_for(config, tokenizer).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    log.info("Exported the policy to %s", path)
    return Path(path)


def save_adapter_dir(adapter: Iterable[tuple[str, torch.Tensor]], lora_config: Any, base_model: str | None,
                     path: str | Path, tokenizer: Any = None) -> Path:
    """Write a peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors`` with
    peft's saved key names) that ``PeftModel.from_pretrained(base, path)`` loads."""
    with staged(path) as tmp:
        write_safetensors(tmp / "adapter_model.safetensors", list(adapter))
        config = copy.deepcopy(lora_config)
        config.base_model_name_or_path = base_model
        config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    log.info("Exported the LoRA adapter to %s", path)
    return Path(path)


def save_hf(module: Any, strategy: Any, sync: Any, path: str | Path, dtype: torch.dtype | None = None,
            lora: str = "merged", max_shard_bytes: int | None = None) -> Path:
    """What :meth:`rltrainer.Trainer.save_hf` does: export the policy of ``module`` on ``strategy``
    to ``path``, once the push in flight (``sync``, ``None`` before setup) has landed."""
    if lora not in LORA_MODES:
        raise ValueError(f"save_hf(lora={lora!r}): choose 'merged' (the policy with the adapter merged in, plain "
                         "transformers weights) or 'adapter' (the LoRA adapter alone, for peft)")
    if module is None or sync is None:
        raise RuntimeError("save_hf needs a set-up Trainer: call it after (or during) fit, or after "
                           "Trainer.fit restored a checkpoint")
    sync.wait()
    tokenizer = getattr(module, "tokenizer", None)
    lora_config = getattr(module, "lora", None)
    shard = max_shard_bytes or getattr(sync, "bucket_bytes", DEFAULT_BUCKET_BYTES)
    if lora == "adapter":
        if lora_config is None:
            raise ValueError("save_hf(lora='adapter'): the policy has no LoRA adapter (the module was built without "
                             "lora=peft.LoraConfig(...)); use lora='merged' (the default) for the whole model.")
        base = module.model_spec if isinstance(module.model_spec, str) else None
        return save_adapter_dir(adapter_weights(strategy, dtype), lora_config, base, path, tokenizer)
    with strategy_view(strategy, "merged" if lora_config is not None else None):
        return save_pretrained_dir(strategy.export_weights(dtype), strategy.model_config(), path, tokenizer, dtype,
                                   shard)


def strategy_view(strategy: Any, mode: str | None) -> Any:
    """A context in which ``strategy`` exports its LoRA policy as ``mode`` (no-op without LoRA)."""
    if mode is None:
        return contextlib.nullcontext()
    return lora_view(strategy, mode)

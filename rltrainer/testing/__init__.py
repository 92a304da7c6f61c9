"""Tiny models and offline data used by tests, notebooks and CPU presets."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from rltrainer.models.moe import routing_shape
from rltrainer.modules.grpo import GRPO
from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout

#: Where the offline data is looked for, in order: ``RLTRAINER_DATA`` alone when it is set; else
#: ``recipes/data`` of the source tree this package was imported from (a clone, or an editable
#: install of one), then ``recipes/data`` under the working directory. A plain ``pip install .``
#: copies only the package, so there only the last two can apply.
CLONE_DATA_DIR = Path(__file__).resolve().parents[2] / "recipes" / "data"


def data_dirs() -> list[Path]:
    """The folders :func:`data_path` looks in, in order (read each call: ``RLTRAINER_DATA`` may change)."""
    if os.environ.get("RLTRAINER_DATA"):
        return [Path(os.environ["RLTRAINER_DATA"])]
    return [CLONE_DATA_DIR, Path.cwd() / "recipes" / "data"]


def _data_dir() -> Path:
    return next((folder for folder in data_dirs() if folder.is_dir()), data_dirs()[0])


#: The offline data folder found when the package was imported (see :func:`data_dirs`).
DATA_DIR = _data_dir()


def data_path(*parts: str) -> Path:
    """A path under the offline data folder (``recipes/data`` of the repository, or
    ``RLTRAINER_DATA``); raises, saying where it looked and how to get the data, if it is missing."""
    folders = data_dirs()
    for folder in folders:
        if folder.is_dir():
            path = folder.joinpath(*parts)
            if path.exists():
                return path
            raise FileNotFoundError(
                f"{path} does not exist. The offline data folder {folder} holds: "
                f"{', '.join(sorted(p.name for p in folder.iterdir())) or 'nothing'}; "
                f"expected the layout of recipes/data in the rltrainer repository (see its README.md)."
            )
    looked = ", ".join(str(folder) for folder in folders)
    if os.environ.get("RLTRAINER_DATA"):
        looked += " (RLTRAINER_DATA, which is not a folder)"
    raise FileNotFoundError(
        f"rltrainer's offline data ({'/'.join(parts) or 'the folder'}) was not found: looked in {looked}. "
        f"It ships in recipes/data of the rltrainer repository, which `pip install .` does not copy into "
        f"the installed package. Get it by running from a clone of the repository (or installing one with "
        f"`pip install -e .`), or set RLTRAINER_DATA to a copy of that folder: "
        f"`export RLTRAINER_DATA=/path/to/rltrainer/recipes/data`."
    )


def load_tokenizer(name: str = "gsm8k-bpe4k") -> Any:
    """A shipped tokenizer: ``"gsm8k-bpe4k"`` (4k entries, fast), ``"qwen2.5-instruct"`` or ``"qwen3"``
    (the same 151,643-token BPE; Qwen3's added tokens, ``<think>`` among them, and its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(data_path("tokenizers", name)))


def tiny_qwen2_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int | None = None, max_positions: int = 1024,
                      **overrides: Any) -> Any:
    """A Qwen2-architecture config for a randomly initialised tiny model (grouped-query attention,
    tied embeddings)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True, use_cache=False, **overrides,
    )


def tiny_qwen3_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, head_dim: int | None = None, intermediate_size: int | None = None,
                      max_positions: int = 1024, **overrides: Any) -> Any:
    """A Qwen3-architecture (dense) config for a randomly initialised tiny model: grouped-query
    attention with RMSNorm on each head's queries and keys (``q_norm``, ``k_norm``), no QKV bias,
    tied embeddings. ``head_dim`` defaults to ``2 * hidden_size // num_heads``: as in Qwen3-0.6B,
    ``num_heads * head_dim`` differs from ``hidden_size`` (``q_proj`` widens, ``o_proj`` narrows).
    ``overrides`` may replace any of these (e.g. ``tie_word_embeddings=False``, as Qwen3-8B)."""
    from transformers import Qwen3Config

    return Qwen3Config(**{
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size or 4 * hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or 2 * hidden_size // num_heads, "max_position_embeddings": max_positions,
        "attention_bias": False, "tie_word_embeddings": True, "use_cache": False, **overrides,
    })


def prepared_batch(module: Any, strategy: Any, prompts: Any) -> Any:
    """One step's batch, laid out as the loop lays it out before the update: connect an ``hf``
    engine to ``strategy`` (recording routes, as the Trainer asks it to, for a MoE policy whose module
    replays or compares them), sync, roll out ``prompts``, reward, run the compute stages, compute
    advantages, and set the global token/row counts. For tests that compare strategies on one batch."""
    engine = HFEngine()
    engine.return_routed_experts = module.records_routes() and routing_shape(strategy.model_config()) is not None
    sync = Rollout(engine).connect(strategy, module.tokenizer)
    sync.push(0, mode="wait")
    engine = sync.engine
    batch = module.reward_step(module.rollout_step(prompts, engine))
    for stage in module.compute_stages():
        batch = batch.union(strategy.compute(batch, stage))
    batch = module.advantage_step(batch)
    batch.global_tokens, batch.global_rows = float(batch["response_mask"].sum()), float(len(batch))
    return batch


def scribble(file: str | Path, size: int = 4096, seed: int = 0) -> None:
    """Overwrite ``size`` bytes in the middle of ``file`` (a quarter of it if it is smaller) with
    random ones: the damage a bad disk or a stray write does, for checkpoint tests."""
    file = Path(file)
    data = bytearray(file.read_bytes())
    n = min(size, len(data) // 4)
    start = len(data) // 2 - n // 2
    data[start:start + n] = random.Random(seed).randbytes(n)
    file.write_bytes(bytes(data))


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A deterministic reward for tests: each response's length in characters, mod 3."""
    return [float(len(c) % 3) for c in completions]


class FrozenEmbeddingGRPO(GRPO):
    """GRPO with the (tied) embedding frozen: a weight sync after a step must skip it."""

    def configure_model(self) -> None:
        super().configure_model()
        self.policy.get_input_embeddings().weight.requires_grad_(False)


class DiscardingHFEngine(HFEngine):
    """The ``hf`` engine with vLLM's ``sleep(level=2)``: only buffers are saved, the weights'
    memory is released without a copy (vllm/v1/worker/gpu_worker.py:301-320; vllm/entrypoints/llm.py:853);
    here they become NaN, and the engine sets ``weights_discarded``."""

    def sleep(self, level: int = 1) -> None:
        super().sleep(1)
        if level == 2:
            with torch.no_grad():
                for p in self._require_model().parameters():
                    p.fill_(float("nan"))
            self.weights_discarded = True


def _slow_engine_class() -> type:
    class SlowHFEngine(HFEngine):
        """The ``hf`` engine with a random delay before each request (uniform in ``delay_s``, drawn
        from its own generator seeded with ``seed`` plus the process id), for pipeline tests."""

        def __init__(self, delay_s: tuple[float, float] = (0.0, 0.2), seed: int = 0, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.delay_s, self.seed = delay_s, seed
            self._random: Any = None

        def generate(self, prompts: Any, sampling: Any) -> Any:
            import random
            import time

            if self._random is None:
                self._random = random.Random(self.seed * 100_003 + os.getpid())
            time.sleep(self._random.uniform(*self.delay_s))
            return super().generate(prompts, sampling)

    return SlowHFEngine


def SlowHFEngine(delay_s: tuple[float, float] = (0.0, 0.2), seed: int = 0, **kwargs: Any) -> Any:  # noqa: N802
    """An ``hf`` engine that sleeps a random time before each request (see ``_slow_engine_class``)."""
    return _slow_engine_class()(delay_s=delay_s, seed=seed, **kwargs)

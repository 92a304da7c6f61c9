"""Checkpoint save and load on 2 FSDP2 (or megatron) ranks (CPU, Ray, gloo): one file through the
controller vs. sharded. Prints a table and writes a JSON file of the figures.

    python tests/benchmarks/bench_checkpoint.py --hidden 512 --layers 8
    python tests/benchmarks/bench_checkpoint.py --strategy megatron --tp 2   # megatron-core, TP=2

A random-init Qwen2-architecture model (the 4k GSM8K BPE vocabulary) trains one GRPO step with AdamW
(so the optimizer holds its moments), then, on the same ranks:

- ``single file``: what a checkpoint was before sharding: the full model and optimizer state
  gathered on rank 0 (``strategy.state_dict()``), shipped to the controller and ``torch.save``d as
  one file; loaded with ``torch.load`` and sent back to every rank (``strategy.load_state_dict``).
- ``sharded``: ``strategy.save_checkpoint(dir)``: every rank writes its own
  ``torch.distributed.checkpoint`` shards; ``strategy.load_checkpoint`` reads them. On megatron:
  each stage's whole tensors under HF names (``rltrainer.strategies.megatron.checkpoint``), which
  any layout loads.
- ``async``: ``save_checkpoint(dir, async_save=True)``: the time training is blocked (the shards
  are copied to host memory), and until the files are written (``wait_checkpoint``; FSDP2 only).
- ``checksums``: what ``checksums.json`` adds to ``sharded``: each rank's sha256 of the files it
  wrote (``strategy.checkpoint_digests``, at save) and of its share of them (``verify_checkpoint``,
  at load, before anything is read).

Each is the median of ``--repeats`` trials; the controller's peak resident memory growth is
measured once per mode (sharded first: the peak only rises).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def zero_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(len(c) % 2) for c in completions]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 1e6


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(strategy: Any, root: Path, repeats: int, async_save: bool = True) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    rss = peak_rss_mb()
    saves, loads, hashes, checks = [], [], [], []
    for i in range(repeats):
        directory = root / f"sharded{i}"
        directory.mkdir()
        state: dict[str, Any] = {}
        digests: dict[str, str] = {}
        saves.append(timed(lambda: state.update(strategy.save_checkpoint(directory))))
        hashes.append(timed(lambda: digests.update(strategy.checkpoint_digests(directory))))
        checks.append(timed(lambda: strategy.verify_checkpoint(directory, digests)))
        loads.append(timed(lambda: strategy.load_checkpoint(directory, state)))
    out["sharded"] = {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
                      "size_mb": size_mb(root / "sharded0"), "controller_peak_rss_growth_mb": peak_rss_mb() - rss}
    out["checksums"] = {"save_s": statistics.median(hashes), "load_s": statistics.median(checks),
                        "size_mb": size_mb(root / "sharded0")}  # sha256 by each rank of its own files
    blocked, total = [], []
    for i in range(repeats if async_save else 0):
        directory = root / f"async{i}"
        directory.mkdir()
        start = time.perf_counter()
        strategy.save_checkpoint(directory, async_save=True)
        blocked.append(time.perf_counter() - start)
        strategy.wait_checkpoint()
        total.append(time.perf_counter() - start)
    if async_save:
        out["async"] = {"blocking_s": statistics.median(blocked), "save_s": statistics.median(total),
                        "size_mb": size_mb(root / "async0")}
    rss = peak_rss_mb()
    saves, loads = [], []
    for i in range(repeats):
        file = root / f"single{i}.pt"
        saves.append(timed(lambda: torch.save(strategy.state_dict(), file)))
        loads.append(timed(lambda: strategy.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))))
    out["single file"] = {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
                          "size_mb": size_mb(root / "single0.pt"), "controller_peak_rss_growth_mb": peak_rss_mb() - rss}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", choices=["fsdp2", "megatron"], default="fsdp2")
    parser.add_argument("--tp", type=int, default=1, help="megatron's tensor_model_parallel_size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_checkpoint.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    from rltrainer import GRPO, Trainer, prompt_dataloader
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.strategies import FSDP2Strategy, MegatronStrategy
    from rltrainer.testing import data_path, load_tokenizer, tiny_qwen2_config

    tok = load_tokenizer("gsm8k-bpe4k")
    rows = prepare_gsm8k(load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(4)), tok, max_prompt_length=160)
    config = tiny_qwen2_config(len(tok), hidden_size=args.hidden, num_layers=args.layers, num_heads=8, num_kv_heads=4)
    module = GRPO(config, tok, reward_funcs=zero_reward, num_generations=2, max_new_tokens=4, lr=1e-4)
    ray_init_kwargs = {"num_cpus": 4, "include_dashboard": False}
    if args.strategy == "megatron":
        strategy = MegatronStrategy(devices=args.devices, tensor_model_parallel_size=args.tp, threads_per_worker=1,
                                    ray_init_kwargs=ray_init_kwargs)
    else:
        strategy = FSDP2Strategy(devices=args.devices, threads_per_worker=1, ray_init_kwargs=ray_init_kwargs)
    with Trainer(strategy=strategy, max_steps=1, logger=False, enable_progress_bar=False) as trainer:
        trainer.fit(module, prompt_dataloader(rows, batch_size=2))
        specs = trainer.strategy.require_group().execute_rank_zero("weight_specs")
        params = sum(math.prod(shape) for shape, _ in specs.values())
        root = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
        try:
            figures = measure(trainer.strategy, root, args.repeats, async_save=args.strategy == "fsdp2")
        finally:
            shutil.rmtree(root, ignore_errors=True)
    result = {"strategy": args.strategy, "tp": args.tp, "hidden": args.hidden, "layers": args.layers,
              "ranks": args.devices, "parameters": params, "figures": figures}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    layout = f"megatron ranks, TP={args.tp}" if args.strategy == "megatron" else "FSDP2 ranks"
    print(f"{params / 1e6:.1f}M parameters, fp32 + AdamW, {args.devices} {layout}")
    print(f"{'mode':<12} {'save s':>8} {'load s':>8} {'blocking s':>10} {'size MB':>8} {'ctrl RSS +MB':>12}")
    for mode, f in figures.items():
        print(f"{mode:<12} {f['save_s']:>8.2f} {f.get('load_s', float('nan')):>8.2f} "
              f"{f.get('blocking_s', f['save_s']):>10.2f} {f['size_mb']:>8.1f} "
              f"{f.get('controller_peak_rss_growth_mb', float('nan')):>12.1f}")


if __name__ == "__main__":
    main()

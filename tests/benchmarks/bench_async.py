"""Steps per minute of the three pipelines, in one run, on the same workload; ``async`` twice:
scheduled (``deterministic=True``, the default: each step's rows come from version
``step - max_staleness`` exactly) and timing-driven (``async_timing``: ``deterministic=False``, each
request takes the newest version the engine holds when it starts, as before issue 44).

Split placement on one machine: the policy trains in this process (FSDP2, one rank, in-process)
and one ``hf`` engine replica generates in a Ray process of its own, one torch thread each. The
workload is sized so that generating a batch and training on it take about the same time (the
``sync`` line prints both), which is where overlapping them pays most: the limit is 2x.

    python tests/benchmarks/bench_async.py                    # sync, one_step_off, async, async_timing
    python tests/benchmarks/bench_async.py --modes async,async_timing,async,async_timing   # alternated
    python tests/benchmarks/bench_async.py --steps 12 --max-new-tokens 96

Prints, per mode: steps/min over the measured steps (after ``--warmup`` steps), the ratio to
sync, the mean staleness of the trained rows, and the share of wall time the trainer waited for
rollouts and the engine sat idle.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, float]:
    from rltrainer import GRPO, AsyncPipeline, Rollout, Trainer, prompt_dataloader
    from rltrainer.callbacks import Callback
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.strategies import FSDP2Strategy
    from rltrainer.testing import data_path, length_reward, load_tokenizer, tiny_qwen2_config

    tokenizer = load_tokenizer("gsm8k-bpe4k")
    config = tiny_qwen2_config(len(tokenizer), hidden_size=args.hidden_size, num_layers=args.num_layers)
    rows = load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(args.batch_size * (args.steps + 2)))
    prompts = prepare_gsm8k(rows, tokenizer, max_prompt_length=args.max_prompt_length)
    module = GRPO(config, tokenizer, reward_funcs=length_reward, num_generations=args.group_size,
                  max_new_tokens=args.max_new_tokens, lr=1e-4)

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.history: list[dict[str, float]] = []

        def on_step_end(self, trainer, module, metrics):  # type: ignore[no-untyped-def]
            self.times.append(time.perf_counter())
            self.history.append(metrics)

    clock = Clock()
    strategy = FSDP2Strategy(devices=1, micro_batch_size=args.micro_batch_size, threads_per_worker=1)
    pipeline = {"async": AsyncPipeline(max_staleness=args.max_staleness),
                "async_timing": AsyncPipeline(max_staleness=args.max_staleness, deterministic=False)}.get(mode, mode)
    with Trainer(strategy=strategy, rollout=Rollout("hf", placement="split"), pipeline=pipeline, max_steps=args.steps, logger=False,
                 enable_progress_bar=False, callbacks=[clock], seed=0) as trainer:
        trainer.fit(module, prompt_dataloader(prompts, args.batch_size))
    measured = clock.history[args.warmup:]
    span = clock.times[-1] - clock.times[args.warmup - 1]

    def mean(key: str) -> float:
        return sum(m.get(key, 0.0) for m in measured) / len(measured)

    return {"mode": mode, "steps_per_min": 60 * len(measured) / span, "step_s": span / len(measured),
            "gen_s": mean("timing_s/gen"), "update_s": mean("timing_s/update_actor") + mean("timing_s/old_log_prob"),
            "staleness": mean("pipeline/staleness_mean"), "trainer_idle": mean("pipeline/trainer_idle_share"),
            "engine_idle": mean("pipeline/engine_idle_share"), "sync_s": mean("timing_s/update_weights")}


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="sync,one_step_off,async,async_timing")
    p.add_argument("--steps", type=int, default=22, help="steps per mode, including --warmup")
    p.add_argument("--warmup", type=int, default=2, help="steps not measured")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    torch.set_num_threads(1)  # this process trains; the engine's process has its own thread
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    results = []
    try:
        for mode in args.modes.split(","):
            results.append(run_mode(mode, args))
    finally:
        ray.shutdown()
    base = next((r["steps_per_min"] for r in results if r["mode"] == "sync"), None)
    print(f"{'mode':14}{'steps/min':>10}{'x sync':>8}{'s/step':>8}{'gen s':>7}{'update s':>9}{'stale':>7}"
          f"{'trainer idle':>13}{'engine idle':>12}")
    for r in results:
        ratio = f"{r['steps_per_min'] / base:.2f}" if base else "-"
        print(f"{r['mode']:14}{r['steps_per_min']:>10.1f}{ratio:>8}{r['step_s']:>8.2f}{r['gen_s']:>7.2f}"
              f"{r['update_s']:>9.2f}{r['staleness']:>7.2f}{r['trainer_idle']:>13.0%}{r['engine_idle']:>12.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()

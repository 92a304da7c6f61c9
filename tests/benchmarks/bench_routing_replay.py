"""Routing replay (R3) against the real vLLM engine: the train/inference mismatch of a bf16
mixture-of-experts policy with replay on and off, over the same steps.

The policy (a tiny Qwen3-MoE: 8 experts, top-2, head size 32, as vLLM's CPU attention needs) trains
with GRPO in this process (FSDP2, one in-process rank, fp32 master weights); one vLLM replica (the
CPU build, in its own environment and Ray process) generates in bf16 and records the experts it
routed each token to. Each mode runs the same seed, prompts and number of steps:

- ``rollout``: every training forward replays the engine's routes (R3);
- ``compare``: the trainer routes by itself and only compares (``moe/routing_agreement``);
- ``off``: no routes recorded (the trainer routes by itself).

Printed per mode, as the mean and median over the steps after ``--warmup``: the rollout-correction
metrics (verl's names: ``rollout_corr/kl``, the token mean of ``log p_rollout - log p_train``;
``rollout_corr/k3_kl``; ``rollout_corr/log_ppl_diff``), ``moe/routing_agreement`` (the share of
(token, layer) whose trainer top-k is the engine's), and the ratio of each mismatch to ``compare``'s.

    python tests/benchmarks/bench_routing_replay.py                      # 60 steps a mode
    python tests/benchmarks/bench_routing_replay.py --steps 80 --modes rollout compare --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

METRICS = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_diff", "moe/routing_agreement",
           "moe/expert_share/max", "critic/score/mean")


def run_mode(mode: str, args: argparse.Namespace) -> list[dict[str, float]]:
    from rltrainer import GRPO, Rollout, Trainer, VLLMEngine, prompt_dataloader
    from rltrainer.callbacks import Callback
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.strategies import FSDP2Strategy
    from rltrainer.testing import data_path, length_reward, load_tokenizer
    from rltrainer.testing.families import tiny_moe_config

    tokenizer = load_tokenizer("gsm8k-bpe4k")
    config = tiny_moe_config(len(tokenizer), hidden_size=args.hidden_size)  # heads of 32 (vLLM's CPU attention)
    rows = load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(args.batch_size * (args.steps + 2)))
    prompts = prepare_gsm8k(rows, tokenizer, max_prompt_length=args.max_prompt_length)
    module = GRPO(config, tokenizer, reward_funcs=length_reward, num_generations=args.group_size,
                  max_new_tokens=args.max_new_tokens, lr=args.lr, routing_replay=mode)

    class History(Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def on_step_end(self, trainer, module, metrics):  # type: ignore[no-untyped-def]
            self.steps.append({k: float(v) for k, v in metrics.items() if k in METRICS})

    history = History()
    strategy = FSDP2Strategy(devices=1, micro_batch_size=args.micro_batch_size, threads_per_worker=1)
    with Trainer(strategy=strategy, rollout=Rollout(VLLMEngine(dtype=torch.bfloat16), placement="split"), max_steps=args.steps, logger=False,
                 enable_progress_bar=False, callbacks=[history], seed=args.seed) as trainer:
        trainer.fit(module, prompt_dataloader(prompts, args.batch_size))
    return history.steps


def summary(steps: list[dict[str, float]], warmup: int) -> dict[str, dict[str, float]]:
    out = {}
    for name in METRICS:
        values = [s[name] for s in steps[warmup:] if name in s]
        if values:
            out[name] = {"mean": statistics.fmean(values), "median": statistics.median(values), "n": len(values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["rollout", "compare"], choices=["rollout", "compare", "off"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--json", default=None, help="write the per-step metrics and the summary here")
    args = parser.parse_args()
    results = {}
    for mode in args.modes:
        start = time.perf_counter()
        steps = run_mode(mode, args)
        results[mode] = {"steps": steps, "summary": summary(steps, args.warmup),
                         "seconds": time.perf_counter() - start}
        print(f"\n{mode}: {len(steps)} steps in {results[mode]['seconds']:.0f} s")
        for name, s in results[mode]["summary"].items():
            print(f"  {name:28s} mean {s['mean']:+.3e}  median {s['median']:+.3e}  (n={s['n']})")
    base = results.get("compare", {}).get("summary", {})
    for mode in args.modes:
        if mode == "compare" or not base:
            continue
        print(f"\n{mode} / compare:")
        for name in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_diff"):
            ours, theirs = results[mode]["summary"].get(name), base.get(name)
            if ours and theirs and theirs["mean"]:
                print(f"  {name:28s} mean {ours['mean'] / theirs['mean']:.3f}x  "
                      f"median {ours['median'] / theirs['median']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

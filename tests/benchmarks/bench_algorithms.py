"""Nine RL algorithms on one task: the addition recipe after the same warm-up, the same samples.

Each run is ``recipes/grpo_addition.py --algorithm A --seed S --steps N`` in a subprocess of its
own (one torch thread): the same seeded warm-up and held-out set for every algorithm of a seed,
then ``N`` steps of ``batch_size x group_size`` samples with that algorithm's module
(``ALGORITHMS`` in the recipe: GRPO, Dr. GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++, ReMax, PPO).
Prints, per algorithm, the held-out accuracy gain (greedy exact match, points) as mean and
min-max over the seeds, the steps trained (DAPO's dynamic sampling draws more prompts a step, so
it trains fewer steps on the same prompt budget), and the wall time of a run.

    python tests/benchmarks/bench_algorithms.py                       # 9 algorithms x 3 seeds, 2 at a time
    python tests/benchmarks/bench_algorithms.py --algorithms grpo,ppo --seeds 0,1 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_addition.py"
ALGORITHMS = "grpo,dr_grpo,dapo,gspo,cispo,rloo,reinforce_pp,remax,ppo"
RESULT = re.compile(r"held-out accuracy ([\d.]+)% -> ([\d.]+)% \(([+-][\d.]+) points;.*?\); (\d+) GRPO steps")


def run_one(algorithm: str, seed: int, steps: int) -> dict[str, float | str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(RECIPE), "--algorithm", algorithm, "--seed", str(seed),
                           "--steps", str(steps), "--print-every", str(steps), "--output-dir", ""],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    found = RESULT.search(proc.stdout)
    if proc.returncode or not found:
        raise RuntimeError(f"{algorithm} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"algorithm": algorithm, "seed": seed, "before": float(found[1]), "after": float(found[2]),
            "gain": float(found[3]), "seconds": seconds, "steps": int(found[4])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", default=ALGORITHMS)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=400, help="RL steps per run (the recipe's default is 800)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--json", default=str(ROOT / "tests" / "benchmarks" / "results" / "algorithms.json"))
    args = parser.parse_args()
    algorithms, seeds = args.algorithms.split(","), [int(s) for s in args.seeds.split(",")]
    jobs = [(a, s) for s in seeds for a in algorithms]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda job: run_one(*job, args.steps), jobs))
    print(f"{'algorithm':14} {'gain mean':>9} {'min':>6} {'max':>6} {'after mean':>10} {'steps':>5} {'run s':>6}  seeds")
    for algorithm in algorithms:
        mine = [r for r in runs if r["algorithm"] == algorithm]
        gains = [r["gain"] for r in mine]
        print(f"{algorithm:14} {statistics.mean(gains):+9.1f} {min(gains):+6.1f} {max(gains):+6.1f} "
              f"{statistics.mean(r['after'] for r in mine):9.1f}% {min(r['steps'] for r in mine):5d} "
              f"{statistics.mean(r['seconds'] for r in mine):6.0f}  "
              + ", ".join(f"{r['seed']}: {r['before']:.1f}->{r['after']:.1f}" for r in mine))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"steps": args.steps, "runs": runs}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

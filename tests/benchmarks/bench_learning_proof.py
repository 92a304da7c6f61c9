"""The learning proof across seeds and numerics: does GRPO raise held-out accuracy on every CPU?

Runs the CI test's configuration of ``recipes/grpo_addition.py`` (``num_val=300``, 200 GRPO steps)
for every seed under every numerics setting, each in a subprocess of its own, and prints one row a
run (warm-up steps, held-out accuracy before and after GRPO, gain, seconds, the machine's 1-minute
load average when it ended) and the smallest gain.
A seed fixes the random numbers, not the trajectory: the settings change how the kernels round.

- ``1-thread``: one torch thread (the recipe's default).
- ``2-threads``: two torch threads. (For this tiny model the trajectories came out bit-identical
  to one thread: its matrices are too small to be split.)
- ``portable``: one thread with ``MKL_CBWR=COMPATIBLE`` (MKL's portable code path instead of the
  CPU's own) and ``ATEN_CPU_CAPABILITY=default`` (ATen's unvectorised kernels), which round
  differently, as another CPU would.
- ``mkl-compatible``: only ``MKL_CBWR=COMPATIBLE`` (the matmuls round differently, the rest does
  not).

Jobs run side by side as long as their threads fit in ``--cores``, so the seconds of a 1-thread run
are those of a run sharing the machine with another.

    python tests/benchmarks/bench_learning_proof.py                      # 5 seeds x 4 settings
    python tests/benchmarks/bench_learning_proof.py --seeds 0 1 --settings 1-thread portable
    python tests/benchmarks/bench_learning_proof.py --model moe --cores 1   # the MoE policy (--model moe)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS: dict[str, tuple[int, dict[str, str]]] = {  # name -> (torch threads, environment)
    "1-thread": (1, {}),
    "2-threads": (2, {}),
    "portable": (1, {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"}),
    "mkl-compatible": (1, {"MKL_CBWR": "COMPATIBLE"}),
}
CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("grpo_addition", sys.argv[1])
recipe = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = recipe
spec.loader.exec_module(recipe)
import transformers
transformers.utils.logging.disable_progress_bar()
config = recipe.Config(seed=int(sys.argv[2]), threads=int(sys.argv[3]), model=sys.argv[4], num_val=300, steps=200,
                       print_every=50)
print("RESULT " + json.dumps(recipe.run(config)), flush=True)
"""


def start(seed: int, setting: str, model: str, log_dir: Path) -> tuple[subprocess.Popen, Path]:
    threads, env = SETTINGS[setting]
    log = log_dir / f"{model}-seed{seed}-{setting}.log"
    cmd = [sys.executable, "-c", CHILD, str(ROOT / "recipes" / "grpo_addition.py"), str(seed), str(threads), model]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **env})
    return proc, log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--model", choices=["dense", "moe"], default="dense", help="the recipe's --model")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="threads that may run at once")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: tests/benchmarks/results/learning_proof[_moe].json")
    args = parser.parse_args()
    suffix = "" if args.model == "dense" else f"_{args.model}"
    args.out = args.out or ROOT / "tests" / "benchmarks" / "results" / f"learning_proof{suffix}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.parent / "learning_proof_logs"
    log_dir.mkdir(exist_ok=True)

    queue = [(seed, setting) for setting in args.settings for seed in args.seeds]
    running: list[tuple[int, str, subprocess.Popen, Path, float]] = []
    results = []
    while queue or running:
        busy = sum(SETTINGS[s][0] for _, s, *_ in running)
        if queue and (not running or busy + SETTINGS[queue[0][1]][0] <= args.cores):
            seed, setting = queue.pop(0)
            running.append((seed, setting, *start(seed, setting, args.model, log_dir), time.perf_counter()))
            continue
        time.sleep(1)
        for job in [j for j in running if j[2].poll() is not None]:
            running.remove(job)
            seed, setting, proc, log, _ = job
            lines = [line for line in log.read_text().splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"seed {seed}, {setting}: exit code {proc.returncode}; see {log}")
            result = {"seed": seed, "setting": setting, "model": args.model, "load_average": os.getloadavg(),
                      **json.loads(lines[-1][len("RESULT "):])}
            results.append(result)
            print(f"seed {seed}, {setting}: {result['acc_before']:.1%} -> {result['acc_after']:.1%} "
                  f"(load average {result['load_average'][0]:.1f})", flush=True)

    print("\n| seed | numerics | warm-up steps | before | after | gain (points) | seconds | load average at the end |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    order = {name: i for i, name in enumerate(SETTINGS)}
    for r in sorted(results, key=lambda r: (r["seed"], order[r["setting"]])):
        gain = 100 * (r["acc_after"] - r["acc_before"])
        print(f"| {r['seed']} | {r['setting']} | {r['warmup_steps']} | {r['acc_before']:.1%} | {r['acc_after']:.1%} "
              f"| {gain:+.1f} | {r['seconds']:.0f} | {r['load_average'][0]:.1f} |")
    gains = [100 * (r["acc_after"] - r["acc_before"]) for r in results]
    print(f"\n{len(results)} runs; smallest gain {min(gains):+.1f} points (the CI test needs +15)")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

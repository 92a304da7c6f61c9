"""GRPO step time and memory, rltrainer against TRL's GRPOTrainer, on the same CPU workload.

    python tests/benchmarks/bench_vs_trl.py                  # both, alternating, 2 warm-up + 10 steps
    python tests/benchmarks/bench_vs_trl.py --steps 4 --rounds 1
    python tests/benchmarks/bench_vs_trl.py --tokenizer qwen2.5-instruct --steps 3 --rounds 1

The workload (issue 4): a Qwen2-architecture model from a config (hidden 256, 4 layers, 4 heads
with 2 KV heads, MLP 1024, tied embeddings, random init, saved with ``save_pretrained``), the
4,096-entry GSM8K BPE tokenizer (``--tokenizer qwen2.5-instruct``: the same model shape with the
Qwen2.5 vocabulary of 151,665 entries), 16 GSM8K prompts per step, 8 samples per prompt, 128 new tokens
at temperature 1, KL coefficient 0.001 to a reference model, lr 1e-6, 2 CPU threads. TRL runs
with its defaults otherwise (``per_device_train_batch_size=8``, so 16 accumulation steps make one
optimizer step of 16 prompts). Each framework runs in a subprocess of its own (peak RSS is that
process's); runs alternate between the frameworks.

Per framework: median and spread of the step time after the warm-up steps, generation tokens/s
(completion tokens over generation time), update tokens/s (prompt + completion tokens over the rest
of the step: reference forward, policy forward/backward, optimizer), peak RSS, the child's user
and system CPU time, and the peak RSS of each phase (RSS sampled every 5 ms in a thread: rltrainer's
generation, reference forward and update; TRL's generation and the rest of its step).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, G, NEW_TOKENS, WARMUP = 16, 8, 128, 2
MICRO_BATCH = int(os.environ.get("RLTRAINER_BENCH_MICRO_BATCH", "8"))  # rows per forward/backward


TOKENIZERS = ("gsm8k-bpe4k", "qwen2.5-instruct")


class MallInfo(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33+): what the allocator holds, in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_gb() -> dict[str, float]:
    """glibc's heap at this moment: ``in_use`` (allocated bytes, heap and mmapped blocks), ``free``
    (freed but kept in the heaps), GB; empty where glibc has no ``mallinfo2``."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return {}
    mallinfo2.restype = MallInfo
    info = mallinfo2()
    return {"in_use": (info.uordblks + info.hblkhd) / 1024 ** 3, "free": info.fordblks / 1024 ** 3}


class RssTrace:
    """Peak RSS per phase: a daemon thread reads ``/proc/self/statm`` every ``interval`` seconds and
    keeps, for the phase running then, the largest RSS seen (GB). Phases nest; the innermost counts.
    ``heap`` holds glibc's in-use and free bytes at the end of each phase's last run."""

    def __init__(self, interval: float = 0.005) -> None:
        self.peaks: dict[str, float] = {}
        self.heap: dict[str, dict[str, float]] = {}
        self._stack = ["setup"]
        self._page = os.sysconf("SC_PAGE_SIZE")
        threading.Thread(target=self._sample, args=(interval,), daemon=True).start()

    def rss_gb(self) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page / 1024 ** 3

    def _sample(self, interval: float) -> None:
        while True:
            phase = self._stack[-1]
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), self.rss_gb())
            time.sleep(interval)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._stack.append(name)
        try:
            yield
        finally:
            self.peaks[name] = max(self.peaks.get(name, 0.0), self.rss_gb())
            self.heap[name] = heap_gb()
            self._stack.pop()

    def wrap(self, owner: object, attribute: str, name: str) -> None:
        """Run ``owner.attribute`` (a function or method) inside ``phase(name)``."""
        original: Callable = getattr(owner, attribute)

        def traced(*args, **kwargs):
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, traced)


def make_model(path: Path, tokenizer_name: str = TOKENIZERS[0]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rltrainer.testing import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_name)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=1024, tie_word_embeddings=True,
                         max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def dataset(tokenizer, steps: int):
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.testing import data_path

    rows = load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(PROMPTS * steps * 2))
    return prepare_gsm8k(rows, tokenizer, max_prompt_length=512).select(range(PROMPTS * steps))


def run_rltrainer(model_path: str, steps: int, trace: RssTrace) -> dict:
    from transformers import AutoTokenizer

    import rltrainer.loop
    from rltrainer import GRPO, Callback, Trainer, prompt_dataloader
    from rltrainer.rollout.hf import HFEngine
    from rltrainer.strategies import SingleDeviceStrategy

    timer = rltrainer.loop.timer

    @contextmanager
    def traced_timer(metrics: dict[str, float], name: str) -> Iterator[None]:
        with timer(metrics, name), trace.phase(name):
            yield

    rltrainer.loop.timer = traced_timer  # reward, ref, adv, update_actor, update_weights
    trace.wrap(HFEngine, "generate", "gen")

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = dataset(tokenizer, steps)
    records: list[dict] = []

    class Record(Callback):
        def on_step_end(self, trainer, module, metrics):
            records.append(dict(metrics))

    module = GRPO(model_path, tokenizer, reward_funcs="gsm8k", num_generations=G, max_new_tokens=NEW_TOKENS,
                  temperature=1.0, lr=1e-6, kl_coef=0.001)
    strategy = SingleDeviceStrategy(device="cpu", micro_batch_size=MICRO_BATCH)
    trainer = Trainer(strategy=strategy, max_steps=steps, logger=False, enable_progress_bar=False, callbacks=[Record()])
    trainer.fit(module, prompt_dataloader(data, batch_size=PROMPTS, shuffle=False))
    out = []
    for m in records:
        gen_tokens = m["rollout/gen_tokens"] if "rollout/gen_tokens" in m else m["response_length/mean"] * PROMPTS * G
        out.append({"step_s": m["timing_s/step"], "gen_s": m["timing_s/gen"], "gen_tokens": gen_tokens,
                    "total_tokens": m["perf/total_num_tokens"],
                    "phases": {k[9:]: v for k, v in m.items() if k.startswith("timing_s/")}})
    return {"steps": out}


def run_trl(model_path: str, steps: int, trace: RssTrace) -> dict:
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rltrainer.rewards import REWARDS

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = dataset(tokenizer, steps).select_columns(["prompt", "ground_truth"])
    gsm8k = REWARDS.get("gsm8k")

    def reward(completions, ground_truth, **kwargs):
        return gsm8k(completions, ground_truth)

    timings = {"gen_s": 0.0, "gen_tokens": 0, "total_tokens": 0}
    records: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timings.update(start=time.perf_counter(), gen_s=0.0, gen_tokens=0, total_tokens=0)

        def on_step_end(self, args, state, control, **kw):
            records.append({"step_s": time.perf_counter() - timings["start"], "gen_s": timings["gen_s"],
                            "gen_tokens": timings["gen_tokens"], "total_tokens": timings["total_tokens"]})

    original_generate = GRPOTrainer._generate_single_turn
    original_score = GRPOTrainer._generate_and_score_completions

    def timed_generate(self, *args, **kwargs):
        start = time.perf_counter()
        out = original_generate(self, *args, **kwargs)
        timings["gen_s"] += time.perf_counter() - start
        return out

    def counted_score(self, *args, **kwargs):
        out = original_score(self, *args, **kwargs)
        timings["gen_tokens"] += int(out["completion_mask"].sum())
        timings["total_tokens"] += int(out["completion_mask"].sum() + out["prompt_mask"].sum())
        return out

    GRPOTrainer._generate_single_turn = timed_generate
    GRPOTrainer._generate_and_score_completions = counted_score
    trace.wrap(GRPOTrainer, "_generate_single_turn", "gen")
    trace.wrap(GRPOTrainer, "training_step", "step_rest")  # generation, scoring, ref, update, ...
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none", max_steps=steps,
                      num_generations=G, max_completion_length=NEW_TOKENS, temperature=1.0, learning_rate=1e-6,
                      beta=0.001, gradient_accumulation_steps=PROMPTS * G // 8, per_device_train_batch_size=8,
                      logging_steps=1, save_strategy="no", seed=0)
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    return {"steps": records}


def child(framework: str, model_path: str, steps: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    trace = RssTrace()
    result = (run_rltrainer if framework == "rltrainer" else run_trl)(model_path, steps, trace)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result.update(peak_rss_gb=usage.ru_maxrss / 1024 ** 2, user_s=usage.ru_utime, sys_s=usage.ru_stime,
                  phase_peak_rss_gb=trace.peaks, phase_end_heap_gb=trace.heap)
    print("RESULT " + json.dumps(result))


def summarize(runs: list[dict], warmup: int) -> dict:
    steps = [s for run in runs for s in run["steps"][warmup:]]
    step_s = [s["step_s"] for s in steps]
    gen = sum(s["gen_tokens"] for s in steps) / sum(s["gen_s"] for s in steps)
    update = sum(s["total_tokens"] for s in steps) / sum(s["step_s"] - s["gen_s"] for s in steps)
    phases = {}
    if all("phases" in s for s in steps):
        phases = {k: statistics.median(s["phases"][k] for s in steps) for k in steps[0]["phases"]}
    return {"step_s_median": statistics.median(step_s), "step_s_min": min(step_s), "step_s_max": max(step_s),
            "phases_median_s": phases,
            "gen_tokens_per_s": gen, "update_tokens_per_s": update,
            "peak_rss_gb": max(run["peak_rss_gb"] for run in runs), "measured_steps": len(step_s),
            "step_s": step_s, "user_s": [run["user_s"] for run in runs], "sys_s": [run["sys_s"] for run in runs],
            "phase_peak_rss_gb": [run["phase_peak_rss_gb"] for run in runs],
            "phase_end_heap_gb": [run["phase_end_heap_gb"] for run in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=WARMUP + 10, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=WARMUP, help="first steps of each run left out of the figures")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads per run")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds (rltrainer, trl, ...)")
    p.add_argument("--only", choices=["rltrainer", "trl"], help="run one framework")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default=TOKENIZERS[0],
                   help="the vocabulary: the 4k GSM8K BPE (default) or Qwen2.5's 151,665 entries")
    p.add_argument("--out", default=str(ROOT / "tests" / "benchmarks" / "results" / "vs_trl.json"))
    p.add_argument("--child", nargs=2, metavar=("FRAMEWORK", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.steps, args.threads)
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} leaves no measured step after --warmup {args.warmup}: "
                         f"give --steps of at least {args.warmup + 1}")
    frameworks = [args.only] if args.only else ["rltrainer", "trl"]
    runs: dict[str, list[dict]] = {f: [] for f in frameworks}
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), args.tokenizer)
        for _ in range(args.rounds):
            for framework in frameworks:
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
                proc = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--threads",
                                       str(args.threads), "--child", framework, tmp],
                                      capture_output=True, text=True, env=env)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not line:
                    raise RuntimeError(f"{framework} run failed:\n{proc.stderr[-4000:]}")
                runs[framework].append(json.loads(line[-1][7:]))
                run = runs[framework][-1]
                phases = {k: round(v, 2) for k, v in run["phase_peak_rss_gb"].items()}
                print(f"{framework}: steps {[round(s['step_s'], 1) for s in run['steps']]}, user {run['user_s']:.0f} s, "
                      f"sys {run['sys_s']:.0f} s, peak RSS {run['peak_rss_gb']:.2f} GB, by phase {phases}", flush=True)
    result = {f: summarize(r, args.warmup) for f, r in runs.items()}
    if len(frameworks) == 2:
        result["ratio_step_time"] = result["rltrainer"]["step_s_median"] / result["trl"]["step_s_median"]
        result["ratio_peak_rss"] = result["rltrainer"]["peak_rss_gb"] / result["trl"]["peak_rss_gb"]
    result.update(date=time.strftime("%Y-%m-%d"), tokenizer=args.tokenizer, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                  threads=args.threads,
                  cpus=os.cpu_count(), python=sys.version.split()[0])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'framework':10} {'step s (median, min-max)':>26} {'gen tok/s':>10} {'update tok/s':>13} {'peak RSS GB':>12}")
    for f in frameworks:
        r = result[f]
        print(f"{f:10} {r['step_s_median']:>12.1f} ({r['step_s_min']:.1f}-{r['step_s_max']:.1f}) {r['gen_tokens_per_s']:>14.0f}"
              f" {r['update_tokens_per_s']:>13.0f} {r['peak_rss_gb']:>12.2f}")
    if len(frameworks) == 2:
        print(f"rltrainer/TRL: step time {result['ratio_step_time']:.2f}x, peak RSS {result['ratio_peak_rss']:.2f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

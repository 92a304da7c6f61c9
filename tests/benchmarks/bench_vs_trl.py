"""GRPO step time and memory, rltrainer against TRL's GRPOTrainer, on the same CPU workload.

    python tests/benchmarks/bench_vs_trl.py                  # both, alternating, 2 warm-up + 10 steps
    python tests/benchmarks/bench_vs_trl.py --steps 4 --rounds 1

The workload (issue 4): a Qwen2-architecture model from a config (hidden 256, 4 layers, 4 heads
with 2 KV heads, MLP 1024, tied embeddings, random init, saved with ``save_pretrained``), the
4,096-entry GSM8K BPE tokenizer, 16 GSM8K prompts per step, 8 samples per prompt, 128 new tokens
at temperature 1, KL coefficient 0.001 to a reference model, lr 1e-6, 2 CPU threads. TRL runs
with its defaults otherwise (``per_device_train_batch_size=8``, so 16 accumulation steps make one
optimizer step of 16 prompts). Each framework runs in a subprocess of its own (peak RSS is that
process's); runs alternate between the frameworks.

Per framework: median and spread of the step time after the warm-up steps, generation tokens/s
(completion tokens over generation time), update tokens/s (prompt + completion tokens over the rest
of the step: reference forward, policy forward/backward, optimizer), peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, G, NEW_TOKENS, WARMUP = 16, 8, 128, 2
MICRO_BATCH = int(os.environ.get("RLTRAINER_BENCH_MICRO_BATCH", "8"))  # rows per forward/backward


def make_model(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rltrainer.testing import load_tokenizer

    tokenizer = load_tokenizer("gsm8k-bpe4k")
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


def run_rltrainer(model_path: str, steps: int) -> dict:
    from rltrainer import GRPO, Callback, Trainer, prompt_dataloader
    from rltrainer.strategies import SingleDeviceStrategy
    from transformers import AutoTokenizer

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


def run_trl(model_path: str, steps: int) -> dict:
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
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none", max_steps=steps,
                      num_generations=G, max_completion_length=NEW_TOKENS, temperature=1.0, learning_rate=1e-6,
                      beta=0.001, gradient_accumulation_steps=PROMPTS * G // 8, per_device_train_batch_size=8,
                      logging_steps=1, save_strategy="no", seed=0)
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    return {"steps": records}


def child(framework: str, model_path: str, steps: int) -> None:
    import torch

    torch.set_num_threads(2)
    result = (run_rltrainer if framework == "rltrainer" else run_trl)(model_path, steps)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2
    print("RESULT " + json.dumps(result))


def summarize(runs: list[dict]) -> dict:
    steps = [s for run in runs for s in run["steps"][WARMUP:]]
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
            "step_s": step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=WARMUP + 10, help="steps per run, warm-up included")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds (rltrainer, trl, ...)")
    p.add_argument("--only", choices=["rltrainer", "trl"], help="run one framework")
    p.add_argument("--out", default=str(ROOT / "tests" / "benchmarks" / "results" / "vs_trl.json"))
    p.add_argument("--child", nargs=2, metavar=("FRAMEWORK", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.steps)
    frameworks = [args.only] if args.only else ["rltrainer", "trl"]
    runs: dict[str, list[dict]] = {f: [] for f in frameworks}
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp))
        for _ in range(args.rounds):
            for framework in frameworks:
                env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
                proc = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--child", framework, tmp],
                                      capture_output=True, text=True, env=env)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not line:
                    raise RuntimeError(f"{framework} run failed:\n{proc.stderr[-4000:]}")
                runs[framework].append(json.loads(line[-1][7:]))
                print(f"{framework}: steps {[round(s['step_s'], 1) for s in runs[framework][-1]['steps']]}", flush=True)
    result = {f: summarize(r) for f, r in runs.items()}
    if len(frameworks) == 2:
        result["ratio_step_time"] = result["rltrainer"]["step_s_median"] / result["trl"]["step_s_median"]
        result["ratio_peak_rss"] = result["rltrainer"]["peak_rss_gb"] / result["trl"]["peak_rss_gb"]
    result.update(date=time.strftime("%Y-%m-%d"), steps=args.steps, warmup=WARMUP, rounds=args.rounds,
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

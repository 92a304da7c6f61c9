"""FSDP2 on CPU: weight-sync throughput and 2-rank vs 1-rank step time. Prints a table and
writes a JSON file of the figures.

    python tests/benchmarks/bench_fsdp2.py sync    # Qwen2.5-0.5B architecture, FSDP2 x2 -> hf engines
    python tests/benchmarks/bench_fsdp2.py step    # GSM8K CPU preset: single vs fsdp2 --devices 2

``sync``: a random-init model of the Qwen2.5-0.5B architecture (fp32, 1.98 GB) on 2 FSDP2 ranks
(Ray, gloo, 1 thread each), each with a colocated ``hf`` engine replica (``--placement
split-shared-memory`` / ``split-object-store`` / ``split-broadcast``: one replica in a process of
its own, fed through shared memory, Ray's object store or trainer rank 0's broadcast). A full sync (every
tensor: the version counters are reset before each trial) is timed from the controller; the
baseline is a plain ``copy_`` of the same number of bytes in one process on one thread, measured
in the same run. Throughput is model bytes delivered per replica per second.

``step``: the GSM8K recipe's CPU preset, the same global batch, with ``--strategy single`` and
with ``--strategy fsdp2 --devices 2``; the median step time after the first step.

``memory``: peak resident memory (VmHWM, reset between phases) of each of 2 FSDP2 ranks (``--strategy
megatron``: 2 megatron-core ranks, ``tensor_model_parallel_size=2``) while
setting up a 2.0B-parameter fp32 model (8.0 GB; Qwen2 architecture, random init saved as
safetensors in ``--model-dir`` by a process of its own first, deleted at the end unless
``--keep-model``) and during one ``train_step``, against the model's full size. The step is
GRPO's loss, backward and an SGD step on 4 rows x 32 tokens with the last 4 of 25 blocks and the
final norm trainable: training all of a 2B fp32 model needs 16 bytes a parameter with AdamW
(32 GB over the ranks), more than a 24 GiB machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def qwen25_05b_config(vocab_size: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def copy_baseline(nbytes: int, trials: int) -> list[float]:
    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return [nbytes / t / 1e9 for t in times]


def bench_sync(args: argparse.Namespace) -> dict:
    import ray

    from rltrainer import GRPO
    from rltrainer.rollout.hf import HFEngine
    from rltrainer.rollout.rollout import Rollout
    from rltrainer.strategies import FSDP2Strategy
    from rltrainer.testing import load_tokenizer

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tokenizer = load_tokenizer("qwen2.5-instruct")
    config = qwen25_05b_config(151936)
    module = GRPO(config, tokenizer, reward_funcs="gsm8k", kl_coef=0.0)
    placement, _, transport = args.placement.partition("-")
    strategy = FSDP2Strategy(devices=2)
    rollout = Rollout(HFEngine(), placement=placement, transport=(transport or "broadcast").replace("-", "_"),
                      bucket_bytes=args.bucket_mb << 20)
    start = time.perf_counter()
    strategy.setup(module, seed=0)
    sync = rollout.connect(strategy, tokenizer)
    setup_s = time.perf_counter() - start
    rates, stats = [], {}
    for _ in range(args.trials):
        strategy.group.execute_all("forget_synced")
        stats = sync.transport.start(0).wait()  # the transport's own stats, seconds included
        rates.append(stats["bytes"] / stats["seconds"] / 1e9)
    nbytes = int(stats["bytes"])
    rollout.teardown()
    strategy.teardown()
    ray.shutdown()
    copy = copy_baseline(nbytes, args.trials)
    return {"placement": args.placement, "model_bytes": nbytes, "tensors": stats["tensors"],
            "buckets": stats["buckets"],
            "bucket_mb": args.bucket_mb, "setup_s": setup_s, "sync_gb_per_s": rates, "copy_gb_per_s": copy,
            "sync_median": statistics.median(rates), "copy_median": statistics.median(copy),
            "ratio": statistics.median(rates) / statistics.median(copy)}


def bench_step(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "recipes"))
    import grpo_gsm8k

    out = {}
    for name, extra in (("single", ["--strategy", "single"]), ("fsdp2x2", ["--strategy", "fsdp2", "--devices", "2"])):
        times: list[dict[str, float]] = []
        argv = ["--preset", "cpu", "--max-steps", str(args.steps), "--val-check-interval", "1000",
                "--val-batches", "0", "--no-progress-bar", "--output-dir", f"/tmp/bench_fsdp2_{name}", *extra]
        summary = run_recipe_collecting_steps(grpo_gsm8k, argv, times)
        phases = {k: statistics.median(t[k] for t in times[1:]) for k in times[0] if k.startswith("timing_s/")}
        step_s = [t["timing_s/step"] for t in times]
        out[name] = {"step_s": step_s, "median_after_first": statistics.median(step_s[1:]), "phases_median": phases,
                     "wall_s": summary["wall_s"]}
    out["speedup_2_vs_1"] = out["single"]["median_after_first"] / out["fsdp2x2"]["median_after_first"]
    return out


def run_recipe_collecting_steps(recipe, argv: list[str], times: list[dict[str, float]]) -> dict:
    from rltrainer import Callback, Trainer

    class StepTimes(Callback):
        def on_step_end(self, trainer, module, metrics):
            times.append(dict(metrics))

    original = Trainer.__init__

    def patched(self, *a, **kw):
        kw["callbacks"] = [*(kw.get("callbacks") or []), StepTimes()]
        original(self, *a, **kw)

    Trainer.__init__ = patched
    try:
        return recipe.main(argv)
    finally:
        Trainer.__init__ = original


def two_billion_config():
    """Qwen2.5-3B's width (hidden 2048, MLP 11008, 16 heads, 2 KV heads), 25 layers, a 32k
    vocabulary (tied): 2.0B parameters, 8.0 GB in fp32."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=32768, hidden_size=2048, intermediate_size=11008, num_hidden_layers=25,
                       num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True, dtype="float32")


def save_random_model(path: str) -> None:
    """The benchmark's "pretrained" checkpoint (runs in a process of its own: it holds all 8 GB)."""
    torch.set_num_threads(2)
    from rltrainer.models import build_causal_lm

    build_causal_lm(two_billion_config(), seed=0).save_pretrained(path, max_shard_size="2GB")


def peak_rss(reset: bool) -> int:
    """This process's peak resident bytes (VmHWM); with ``reset``, the peak restarts from now."""
    with open("/proc/self/status") as f:
        peak = int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return peak


def bench_memory(args: argparse.Namespace) -> dict:
    import multiprocessing

    import ray

    from rltrainer import GRPO
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.strategies import FSDP2Strategy, MegatronStrategy
    from rltrainer.testing import load_tokenizer

    base = MegatronStrategy if args.strategy == "megatron" else FSDP2Strategy

    class MemoryWorker(base.worker_cls):
        def setup(self, module, options, seed):
            self.rss = {"before_setup": peak_rss(reset=True)}  # imports, Ray, the process group
            start = time.perf_counter()
            super().setup(module, options, seed)
            self.rss.update(setup_peak=peak_rss(reset=True), setup_s=time.perf_counter() - start)

        def memory(self, phase: str | None = None) -> dict:
            if phase:
                self.rss[phase] = peak_rss(reset=True)
            return self.rss

    class MemoryStrategy(base):
        worker_cls = MemoryWorker

    class PartlyFrozenGRPO(GRPO):
        def configure_model(self):
            super().configure_model()
            self.policy.requires_grad_(False)
            for block in self.policy.model.layers[-4:]:
                block.requires_grad_(True)
            self.policy.model.norm.requires_grad_(True)

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.policy.parameters() if p.requires_grad], lr=1e-4)

    path = Path(args.model_dir)
    start = time.perf_counter()
    if not (path / "config.json").exists():
        proc = multiprocessing.get_context("spawn").Process(target=save_random_model, args=(str(path),))
        proc.start()
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"saving the model to {path} failed (exit code {proc.exitcode})")
    save_s = time.perf_counter() - start
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    if __name__ != "__main__":  # imported: the ranks cannot import this script, so its classes travel by value
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    tokenizer = load_tokenizer("gsm8k-bpe4k")
    module = PartlyFrozenGRPO(str(path), tokenizer, reward_funcs="gsm8k", kl_coef=0.0, max_new_tokens=16)
    kwargs = {"tensor_model_parallel_size": 2} if args.strategy == "megatron" else {}
    strategy = MemoryStrategy(devices=2, micro_batch_size=2, **kwargs)
    try:
        strategy.setup(module, seed=0)
        reports = strategy.group.execute_all("load_report")
        n, P, T = 4, 16, 16
        ids = torch.randint(0, len(tokenizer), (n, P + T), generator=torch.Generator().manual_seed(0))
        batch = RolloutBatch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                              "position_ids": torch.arange(P + T).expand(n, -1).clone(), "responses": ids[:, P:],
                              "response_mask": torch.ones(n, T, dtype=torch.long),
                              "advantages": torch.randn(n, 1).expand(n, T).clone()})
        batch.global_tokens, batch.global_rows = float(n * T), float(n)
        start = time.perf_counter()
        metrics = strategy.train_step(batch)
        step_s = time.perf_counter() - start
        rss = strategy.group.execute_all("memory", "step_peak")
    finally:
        strategy.teardown()
        ray.shutdown()
        if not args.keep_model:
            shutil.rmtree(path, ignore_errors=True)
    full = reports[0]["policy"]["full_bytes"]
    return {"strategy": args.strategy, "model_bytes": full, "params": full // 4, "save_s": save_s, "step_s": step_s,
            "grad_norm": metrics["actor/grad_norm"], "ranks": [
                {**r, "shard_bytes": rep["policy"]["shard_bytes"], "loaded_bytes": rep["policy"]["loaded_bytes"],
                 "setup_goal_bytes": 0.6 * full + 1e9} for r, rep in zip(rss, reports)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["sync", "step", "memory"])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--placement", choices=["colocated", "split-shared-memory", "split-object-store", "split-broadcast"],
                   default="colocated",
                   help="sync: engines in the training ranks, or one replica of its own fed through /dev/shm, "
                        "Ray's object store or a broadcast")
    p.add_argument("--model-dir", default="/tmp/rltrainer_bench_2b", help="memory: where the 2B checkpoint goes")
    p.add_argument("--keep-model", action="store_true", help="memory: keep the checkpoint (reused when present)")
    p.add_argument("--strategy", choices=["fsdp2", "megatron"], default="fsdp2",
                   help="memory: 2 FSDP2 ranks, or 2 megatron ranks with tensor_model_parallel_size=2")
    p.add_argument("--out", default=None, help="JSON output (default: tests/benchmarks/results/fsdp2_<what>.json)")
    args = p.parse_args()
    torch.set_num_threads(1)
    result = {"sync": bench_sync, "step": bench_step, "memory": bench_memory}[args.what](args)
    result.update(what=args.what, date=time.strftime("%Y-%m-%d"), torch=torch.__version__, cpus=os.cpu_count())
    name = f"megatron_{args.what}" if args.what == "memory" and args.strategy == "megatron" else f"fsdp2_{args.what}"
    out = Path(args.out or ROOT / "tests" / "benchmarks" / "results" / f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if args.what == "sync":
        print(f"model {result['model_bytes'] / 1e9:.2f} GB, {result['tensors']} tensors, {result['buckets']} buckets")
        print(f"{'':24}{'median GB/s':>12}  trials")
        print(f"{'fsdp2 x2 -> hf ' + result['placement']:24}{result['sync_median']:>12.2f}  {[round(r, 2) for r in result['sync_gb_per_s']]}")
        print(f"{'plain copy_ (1 thread)':24}{result['copy_median']:>12.2f}  {[round(r, 2) for r in result['copy_gb_per_s']]}")
        print(f"ratio sync/copy: {result['ratio']:.2f}")
    elif args.what == "memory":
        gb = 1e9
        print(f"model {result['params'] / 1e9:.2f}B parameters, {result['model_bytes'] / gb:.2f} GB fp32; "
              f"setup goal per rank: 0.6 x model + 1 GB = {result['ranks'][0]['setup_goal_bytes'] / gb:.2f} GB")
        print(f"{'rank':6}{'before setup':>14}{'setup peak':>12}{'x model':>9}{'step peak':>11}{'x model':>9}"
              f"{'shard':>8}{'read':>8}")
        for i, r in enumerate(result["ranks"]):
            print(f"{i:<6}{r['before_setup'] / gb:>12.2f}GB{r['setup_peak'] / gb:>10.2f}GB"
                  f"{r['setup_peak'] / result['model_bytes']:>9.2f}{r['step_peak'] / gb:>9.2f}GB"
                  f"{r['step_peak'] / result['model_bytes']:>9.2f}{r['shard_bytes'] / gb:>6.2f}GB"
                  f"{r['loaded_bytes'] / gb:>6.2f}GB")
        print(f"save {result['save_s']:.0f} s, setup {result['ranks'][0]['setup_s']:.0f} s, "
              f"step {result['step_s']:.0f} s")
    else:
        for name in ("single", "fsdp2x2"):
            r = result[name]
            print(f"{name:10} median step {r['median_after_first']:.2f} s  steps {[round(t, 2) for t in r['step_s']]}")
            print("           " + ", ".join(f"{k[9:]} {v:.2f}" for k, v in r["phases_median"].items()))
        print(f"speed-up 2 ranks vs 1: {result['speedup_2_vs_1']:.2f}x")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

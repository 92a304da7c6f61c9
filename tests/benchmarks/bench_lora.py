"""LoRA rank 16 against full fine-tuning: peak memory and the bytes of each weight sync.

    python tests/benchmarks/bench_lora.py                 # 3 steps each, single strategy, hf engine
    python tests/benchmarks/bench_lora.py --steps 2 --new-tokens 32 --prompts 4   # a short run

The workload is ``bench_vs_trl.py``'s (a Qwen2-architecture model, hidden 256, 4 layers, MLP 1024,
tied embeddings, random init saved with ``save_pretrained``; 16 GSM8K prompts (``--prompts``) x 8 samples; KL 0.001
to the reference; lr 1e-6, 2 threads), with ``--new-tokens`` (default 64) new tokens. LoRA: ``r=16,
lora_alpha=32`` on every attention and MLP projection (``target_modules="all-linear"``, the LM head
excepted by peft). Each mode runs in a subprocess of its own (peak RSS is that process's).

Per mode: trainable parameters, the bytes and tensors of the sync after each step (the one at setup
sends every weight in both modes: the engine starts empty), the reference model (a frozen copy, or the base with the adapter
disabled), peak RSS, and the median step time.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import G, PROMPTS, dataset, make_model  # noqa: E402


def run(mode: str, model_path: str, steps: int, new_tokens: int, prompts: int) -> dict:
    import peft
    import torch
    from transformers import AutoTokenizer

    from rltrainer import GRPO, Callback, Trainer, prompt_dataloader
    from rltrainer.strategies import SingleDeviceStrategy

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    records: list[dict] = []

    class Record(Callback):
        def on_step_end(self, trainer, module, metrics):
            records.append(dict(metrics))

    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if mode == "lora" else None
    module = GRPO(model_path, tokenizer, reward_funcs="gsm8k", num_generations=G, max_new_tokens=new_tokens,
                  lr=1e-6, kl_coef=0.001, lora=lora)
    trainer = Trainer(strategy=SingleDeviceStrategy(device="cpu", micro_batch_size=8), max_steps=steps, logger=False,
                      enable_progress_bar=False, callbacks=[Record()])
    data = dataset(tokenizer, steps).select(range(prompts * steps))
    trainer.fit(module, prompt_dataloader(data, batch_size=prompts, shuffle=False))
    params = list(module.policy.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return {"mode": mode, "trainable_params": trainable, "total_params": sum(p.numel() for p in params),
            "reference": "frozen copy" if module.ref_policy is not None else "base, adapter disabled",
            "sync_bytes": [m["sync/bytes"] for m in records], "sync_tensors": [m["sync/tensors"] for m in records],
            "step_s_median": statistics.median(m["timing_s/step"] for m in records[1:] or records),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per step (x 8 samples)")
    p.add_argument("--child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_lora.json"),
                   help="where the JSON of the results goes")
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run(args.child[0], args.child[1], args.steps, args.new_tokens, args.prompts)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp))
        for mode in ("full", "lora"):
            proc = subprocess.run([sys.executable, __file__, "--child", mode, tmp, "--steps", str(args.steps),
                                   "--new-tokens", str(args.new_tokens), "--prompts", str(args.prompts)],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"the {mode} run failed:\n{proc.stderr[-4000:]}")
            line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
            results[mode] = json.loads(line[len("RESULT "):])
    print(f"{'':28}{'full':>16}{'lora r=16':>16}")
    for key, label in (("trainable_params", "trainable params"), ("reference", "reference model"),
                       ("peak_rss_gb", "peak RSS (GB)"), ("step_s_median", "step (s, median)")):
        f, lo = results["full"][key], results["lora"][key]
        fmt = (lambda v: f"{v:>16.3f}") if isinstance(f, float) else (lambda v: f"{v!s:>16}")
        print(f"{label:28}{fmt(f)}{fmt(lo)}")
    for key, label in (("sync_bytes", "bytes per step's sync"), ("sync_tensors", "tensors per step's sync")):
        f, lo = results["full"][key], results["lora"][key]
        print(f"{label:28}{int(statistics.median(f)):>16,}{int(statistics.median(lo)):>16,}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

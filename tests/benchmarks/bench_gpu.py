"""GRPO on one GPU: update-phase MFU, decode tokens/s, weight-sync GB/s next to a device-to-device
copy of the same bytes. Needs torch and transformers only (plus tensordict, see gpu.sh); no Ray,
no vLLM, no datasets.

    bash tests/benchmarks/gpu.sh                       # the lent H200: Qwen2.5-0.5B architecture, bf16
    python tests/benchmarks/bench_gpu.py --device cpu --model tiny --steps 2    # a smoke run anywhere

Model: a random-init model of the Qwen2.5-0.5B architecture (494M parameters, tied embeddings)
with the real Qwen2.5 tokenizer and GSM8K prompts from ``recipes/data``. Training runs in
``bf16-mixed`` (fp32 master weights, bf16 autocast) with the ``single`` strategy or 1-rank
``fsdp2`` (bf16 parameters, fp32 reduce), or ``bf16-true`` with ``--strategy megatron``
(megatron-core on one rank: its schedule, its attention, export to HF names; needs megatron-core,
carried as a wheel by gpu.sh); the ``hf`` engine holds bf16 weights.

MFU counts the policy's forward and backward in the update phase: ``6 x parameters x tokens``
plus attention's ``12 x layers x hidden x tokens x mean sequence length``, over the update time,
over the chip's 989 dense bf16 TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PEAK_BF16 = 989e12


def model_config(size: str, vocab_size: int):
    from transformers import Qwen2Config

    if size == "tiny":
        return Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2Config(vocab_size=vocab_size, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def gsm8k_rows(tokenizer, count: int) -> list[dict]:
    """GSM8K prompts, chat-templated, without the datasets library."""
    from rltrainer.data.datasets import GSM8K_INSTRUCTION
    from rltrainer.testing import data_path

    rows = []
    with open(data_path("gsm8k", "train.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            messages = [{"role": "user", "content": f"{row['question']} {GSM8K_INSTRUCTION}"}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            rows.append({"prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"],
                         "ground_truth": row["answer"].split("####")[-1].strip().replace(",", "")})
            if len(rows) == count:
                return rows
    return rows


def copy_gb_per_s(nbytes: int, device: torch.device, trials: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rates = []
    for _ in range(trials + 1):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates[1:])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    from rltrainer import GRPO, Callback, Trainer, prompt_dataloader
    from rltrainer.rollout.hf import HFEngine
    from rltrainer.strategies import FSDP2Strategy, SingleDeviceStrategy
    from rltrainer.testing import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=["0.5b", "tiny"], default="0.5b")
    p.add_argument("--strategy", choices=["single", "fsdp2", "megatron"], default="single",
                   help="megatron: megatron-core on one rank (bf16-true), its schedule and HF export")
    p.add_argument("--steps", type=int, default=5, help="GRPO steps (the first is a warm-up)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "tests" / "benchmarks" / "results" / "gpu.json"))
    args = p.parse_args()
    device = torch.device(args.device)
    tokenizer = load_tokenizer("qwen2.5-instruct")
    config = model_config(args.model, len(tokenizer))
    rows = gsm8k_rows(tokenizer, args.prompts * args.steps)
    module = GRPO(config, tokenizer, reward_funcs="gsm8k", num_generations=args.group,
                  max_new_tokens=args.max_new_tokens, lr=1e-6, kl_coef=0.001)
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    if args.strategy == "single":
        strategy = SingleDeviceStrategy(device=str(device), precision=precision, micro_batch_size=args.micro_batch_size)
    elif args.strategy == "fsdp2":
        strategy = FSDP2Strategy(devices=1, precision=precision, micro_batch_size=args.micro_batch_size)
    else:
        from rltrainer.strategies import MegatronStrategy

        precision = "bf16-true" if device.type == "cuda" else "32-true"  # megatron-core takes no autocast mix
        strategy = MegatronStrategy(devices=1, precision=precision, micro_batch_size=args.micro_batch_size)
    engine = HFEngine(dtype=torch.bfloat16 if device.type == "cuda" else None, max_batch_size=512)
    steps: list[dict] = []

    class Record(Callback):
        def on_step_end(self, trainer, module, metrics):
            steps.append(dict(metrics))
            print(f"step {len(steps)}: " + ", ".join(f"{k} {metrics[k]:.3g}" for k in (
                "timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights") if k in metrics),
                flush=True)

    start = time.perf_counter()
    with Trainer(strategy=strategy, rollout=engine, max_steps=args.steps, logger=False, enable_progress_bar=False,
                 callbacks=[Record()]) as trainer:
        trainer.fit(module, prompt_dataloader(rows, batch_size=args.prompts, shuffle=False))
        params = sum(t.numel() for _, t in trainer.strategy.export_weights())
    wall = time.perf_counter() - start

    measured = steps[1:] or steps
    L, H = config.num_hidden_layers, config.hidden_size
    mfu, decode, sync_rates, sync_bytes = [], [], [], 0
    for m in measured:
        tokens = m["perf/total_num_tokens"]
        mean_seq = tokens / (args.prompts * args.group)
        flops = 6 * params * tokens + 12 * L * H * tokens * mean_seq
        mfu.append(flops / m["timing_s/update_actor"] / PEAK_BF16)
        decode.append(m["response_length/mean"] * args.prompts * args.group / m["timing_s/gen"])
        if m.get("sync/gb_per_s"):
            sync_rates.append(m["sync/gb_per_s"])
            sync_bytes = int(m["sync/bytes"])
    copy = copy_gb_per_s(sync_bytes or params * 2, device)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "model": args.model, "params": params, "strategy": args.strategy,
              "precision": precision, "prompts": args.prompts, "group": args.group,
              "max_new_tokens": args.max_new_tokens, "steps": args.steps, "wall_s": wall,
              "update_mfu_median": statistics.median(mfu), "decode_tokens_per_s_median": statistics.median(decode),
              "sync_gb_per_s_median": statistics.median(sync_rates) if sync_rates else None, "sync_bytes": sync_bytes,
              "copy_gb_per_s": copy, "step_s": [m["timing_s/step"] for m in steps]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"model {args.model} ({params / 1e6:.0f}M params), {args.strategy}, {precision}, "
          f"{args.prompts}x{args.group} samples x {args.max_new_tokens} new tokens, {args.steps} steps, {wall:.0f} s")
    print(f"update MFU (of {PEAK_BF16 / 1e12:.0f} TFLOP/s): {result['update_mfu_median']:.1%}")
    print(f"decode tokens/s: {result['decode_tokens_per_s_median']:.0f}")
    sync_text = f"{result['sync_gb_per_s_median']:.1f}" if sync_rates else "n/a (no changed weights)"
    print(f"weight sync GB/s: {sync_text}; device-to-device copy of the same bytes: {copy:.1f} GB/s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

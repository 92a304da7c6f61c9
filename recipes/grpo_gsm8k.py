"""GRPO on GSM8K.

    python recipes/grpo_gsm8k.py                 # GPU: Qwen2.5-0.5B-Instruct (CPU preset without CUDA)
    python recipes/grpo_gsm8k.py --model Qwen/Qwen3-0.6B                    # GPU: Qwen3 (tokenizer: the model's)
    python recipes/grpo_gsm8k.py --preset cpu    # offline CPU run: tiny random Qwen2 + the real tokenizer
    python recipes/grpo_gsm8k.py --preset cpu --model tiny-qwen3            # the same with Qwen3 (+ its tokenizer)
    python recipes/grpo_gsm8k.py --preset cpu --strategy fsdp2 --devices 2   # the same on 2 FSDP2 ranks (Ray)
    python recipes/grpo_gsm8k.py --preset cpu --pipeline one_step_off        # generate while training (Ray)

The CPU preset builds a tiny Qwen2-architecture model from a config (random init) with the real
Qwen2.5 tokenizer (``--model tiny-qwen3``: a tiny Qwen3 with the Qwen3 tokenizer) and the GSM8K
copy shipped in recipes/data, so it runs anywhere with no hub
access; it shows the pipeline working end to end (a random model scores ~0 on GSM8K). The GPU
preset is what a user wants on real hardware. Every preset value can be overridden by a flag.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from rltrainer import GRPO, AsyncPipeline, OneStepOffPipeline, Rollout, SyncPipeline, Trainer, prompt_dataloader
from rltrainer.data import load_rows, prepare_gsm8k
from rltrainer.strategies import build_strategy
from rltrainer.testing import data_path, tiny_qwen2_config, tiny_qwen3_config

#: ``--model`` names of tiny random-init models (the shipped tokenizer each uses by default).
TINY_MODELS = {"tiny-qwen2": (tiny_qwen2_config, "qwen2.5-instruct"), "tiny-qwen3": (tiny_qwen3_config, "qwen3")}

PRESETS = {
    "gpu": dict(model="Qwen/Qwen2.5-0.5B-Instruct", tokenizer=None, precision="bf16-mixed",
                batch_size=32, num_generations=8, max_new_tokens=512, max_prompt_length=512, lr=1e-6,
                kl_coef=0.001, max_steps=200, micro_batch_size=16, val_check_interval=25, val_batches=10,
                threads=None),
    "cpu": dict(model="tiny-qwen2", tokenizer=None, precision="32-true", batch_size=4, num_generations=4,
                max_new_tokens=48, max_prompt_length=256, lr=1e-4, kl_coef=0.001, max_steps=20,
                micro_batch_size=8, val_check_interval=10, val_batches=2, threads=1),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["auto", "gpu", "cpu"], default="auto",
                   help="auto: gpu if CUDA is available, else cpu")
    p.add_argument("--strategy", default="single", help="a registered strategy name")
    p.add_argument("--rollout", default="hf", help="a registered rollout engine name")
    p.add_argument("--devices", type=int, default=1, help="training ranks (fsdp2: Ray workers when > 1)")
    p.add_argument("--push-mode", choices=["wait", "background"], default="wait",
                   help="sync pipeline: wait for each step's weight push, or push in the background")
    p.add_argument("--pipeline", choices=["sync", "one_step_off", "async"], default="sync",
                   help="one_step_off / async: generate while the policy trains (engines in processes of their own; "
                        "strategy 'single' becomes one in-process fsdp2 rank)")
    p.add_argument("--max-staleness", type=int, default=1, help="async: policy versions a trained row may lag")
    p.add_argument("--rollout-correction", default="auto",
                   help="a ROLLOUT_CORRECTIONS name, or none; auto: token_tis unless --pipeline sync")
    p.add_argument("--model", help=f"hub id, local path, or {' / '.join(TINY_MODELS)} (default: the preset's)")
    p.add_argument("--tokenizer", help="hub id or local path (default: the model's; a tiny model's shipped one)")
    p.add_argument("--train-file", default=str(data_path("gsm8k", "train.jsonl")))
    p.add_argument("--val-file", default=str(data_path("gsm8k", "test.jsonl")))
    for name, kind in [("precision", str), ("batch_size", int), ("num_generations", int), ("max_new_tokens", int),
                       ("max_prompt_length", int), ("lr", float), ("kl_coef", float), ("max_steps", int),
                       ("micro_batch_size", int), ("val_check_interval", int), ("val_batches", int)]:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, help="default: the preset's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: the preset's; gpu: torch's default)")
    p.add_argument("--output-dir", default="outputs/grpo_gsm8k")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument("--padding-free", action="store_true",
                   help="pack each micro-batch's rows without their padding (the strategy's padding_free=True)")
    args = p.parse_args(argv)
    preset = args.preset if args.preset != "auto" else ("gpu" if torch.cuda.is_available() else "cpu")
    for key, value in PRESETS[preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.preset = preset
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tiny_config, shipped = TINY_MODELS.get(args.model, (None, None))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or (str(data_path("tokenizers", shipped)) if shipped
                                                                 else args.model))
    model = tiny_config(len(tokenizer)) if tiny_config else args.model

    train = prepare_gsm8k(load_rows(args.train_file), tokenizer, max_prompt_length=args.max_prompt_length)
    val = prepare_gsm8k(load_rows(args.val_file), tokenizer, max_prompt_length=args.max_prompt_length)
    correction = args.rollout_correction
    if correction == "auto":
        correction = "none" if args.pipeline == "sync" else "token_tis"
    module = GRPO(model, tokenizer, reward_funcs="gsm8k", num_generations=args.num_generations,
                  max_new_tokens=args.max_new_tokens, lr=args.lr, kl_coef=args.kl_coef,
                  rollout_correction=None if correction == "none" else correction)
    if args.pipeline != "sync":  # overlapping needs the engines in processes of their own
        args.strategy = "fsdp2" if args.strategy == "single" else args.strategy
    per_rank = {"threads_per_worker": args.threads} if args.strategy.startswith("fsdp2") and args.threads else {}
    rollout = Rollout(args.rollout, placement="split" if args.pipeline != "sync" else "colocated")
    strategy = build_strategy(args.strategy, devices=args.devices, precision=args.precision,
                              micro_batch_size=args.micro_batch_size, padding_free=args.padding_free, **per_rank)
    pipeline = (SyncPipeline(push_mode=args.push_mode) if args.pipeline == "sync" else OneStepOffPipeline()
                if args.pipeline == "one_step_off" else AsyncPipeline(max_staleness=args.max_staleness))
    start = time.perf_counter()
    with Trainer(strategy=strategy, rollout=rollout, max_steps=args.max_steps, seed=args.seed,
                 val_check_interval=args.val_check_interval, limit_val_batches=args.val_batches,
                 default_root_dir=args.output_dir, enable_progress_bar=not args.no_progress_bar,
                 pipeline=pipeline) as trainer:
        trainer.fit(module, prompt_dataloader(train, args.batch_size, seed=args.seed),
                    val_dataloaders=prompt_dataloader(val, args.batch_size, shuffle=False, drop_last=False))
    keep = ("val/", "critic/score", "timing_s/step")
    summary = {k: v for k, v in trainer.callback_metrics.items() if k.startswith(keep)}
    summary["wall_s"] = time.perf_counter() - start
    logging.getLogger("grpo_gsm8k").info("preset=%s done: %s", args.preset, json.dumps(summary))
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()

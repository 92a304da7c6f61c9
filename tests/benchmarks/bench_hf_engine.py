"""Micro benchmark: HFEngine's decode loop vs ``model.generate`` (tokens/s), tiny random Qwen2.

Run from the repository root::

    python tests/benchmarks/bench_hf_engine.py [--batch-sizes 16 64 256] [--new-tokens 128] [--threads 1]
    python tests/benchmarks/bench_hf_engine.py --tokenizer qwen2.5-instruct --batch-sizes 128 --full-logits

Both sample at temperature 1 with no top-k/top-p and stop at EOS; tokens/s counts generated tokens.
``--tokenizer qwen2.5-instruct``: the same model shape with Qwen2.5's 151,665-token vocabulary.
``--full-logits`` also times the engine on the model's own ``[rows, V]`` logits (its sampling as
before row chunks, ``HFEngine._head = None``), and prints each variant's system CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from rltrainer.rollout.engine import SamplingParams
from rltrainer.rollout.hf import HFEngine
from rltrainer.testing import DATA_DIR

ROOT = DATA_DIR
TOKENIZERS = ("gsm8k-bpe4k", "qwen2.5-instruct")


def build(device: str, tokenizer_name: str = TOKENIZERS[0]):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "tokenizers" / tokenizer_name)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device).eval()
    return config, tokenizer, model


def load_prompts(tokenizer, count: int) -> list[list[int]]:
    path = ROOT / "gsm8k/test.jsonl"
    if path.exists():
        questions = [json.loads(line)["question"] for line in path.read_text().splitlines()[:count]]
    else:
        questions = [f"Question {i}: what is {i} plus {2 * i}?" * (1 + i % 3) for i in range(count)]
    return [tokenizer.encode(q) for q in questions]


class Timer:
    """Wall-clock and process CPU seconds (CPU time is the steadier figure on a shared machine)."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu, self.sys = time.perf_counter(), time.process_time(), os.times().system
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        self.sys = os.times().system - self.sys


def time_engine(engine: HFEngine, prompts: list[list[int]], new_tokens: int) -> tuple[int, Timer]:
    with Timer() as timer:
        gen = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, seed=0))
    return int(gen.metrics["gen_tokens"]), timer


def time_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> tuple[int, Timer]:
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
    with Timer() as timer, torch.inference_mode():
        out = model.generate(**batch, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                             max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
    new = out[:, batch["input_ids"].shape[1]:]
    ended = (new == tokenizer.eos_token_id).int().cumsum(1)
    tokens = int(((ended == 0) | ((ended == 1) & (new == tokenizer.eos_token_id))).sum())  # up to and incl. EOS
    return tokens, timer


def compare_full_logits(engine: HFEngine, config, tokenizer, model, args) -> None:
    """The engine with row-chunked sampling against the same engine on full logits, interleaved."""
    full = HFEngine(share_weights=False)
    full.setup(config, tokenizer, device=args.device)
    full.update_weights(model.named_parameters())
    full._head = None
    print(f"torch threads={torch.get_num_threads()} vocab={config.vocab_size} new_tokens={args.new_tokens} "
          f"(median of {args.repeats}, interleaved)")
    rows = []
    for bs in args.batch_sizes:
        prompts = load_prompts(tokenizer, bs)
        time_engine(engine, prompts, 4), time_engine(full, prompts, 4)  # warm-up
        runs: dict[str, list[tuple[int, Timer]]] = {"row chunks": [], "full logits": []}
        for _ in range(args.repeats):
            for name, eng in (("row chunks", engine), ("full logits", full)):
                runs[name].append(time_engine(eng, prompts, args.new_tokens))
        row = {"batch": bs}
        for name, results in runs.items():
            tokens = results[0][0]
            wall, cpu, sys_ = (sorted(getattr(t, k) for _, t in results)[len(results) // 2] for k in ("wall", "cpu", "sys"))
            print(f"batch {bs:>4} {name:>11}: {tokens} tokens, wall {wall:.2f} s ({tokens / wall:.0f} tok/s), "
                  f"cpu {cpu:.2f} s, of it system {sys_:.2f} s")
            row[name] = {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "sys_s": sys_}
        rows.append(row)
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "vocab": config.vocab_size,
                                          "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default=TOKENIZERS[0])
    parser.add_argument("--full-logits", action="store_true", help="also time the engine on full [rows, V] logits")
    parser.add_argument("--out", default="tests/benchmarks/results/hf_engine.json", help="JSON file of the figures")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config, tokenizer, model = build(args.device, args.tokenizer)
    engine = HFEngine(share_weights=False)
    engine.setup(config, tokenizer, device=args.device)
    engine.update_weights(model.named_parameters())
    if args.full_logits:
        return compare_full_logits(engine, config, tokenizer, model, args)
    print(f"torch threads={torch.get_num_threads()} device={args.device} new_tokens={args.new_tokens} "
          f"(tok/s, best of {args.repeats}, interleaved)")
    print(f"{'batch':>5} | {'engine wall':>11} {'generate wall':>13} {'ratio':>5} | "
          f"{'engine cpu':>10} {'generate cpu':>12} {'ratio':>5}")
    rows = []
    for bs in args.batch_sizes:
        prompts = load_prompts(tokenizer, bs)
        time_engine(engine, prompts, 8), time_generate(model, tokenizer, prompts, 8)  # warm-up
        best = {"engine": [0.0, 0.0], "generate": [0.0, 0.0]}  # [wall tok/s, cpu tok/s]
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            for name, (tokens, t) in (("engine", time_engine(engine, prompts, args.new_tokens)),
                                      ("generate", time_generate(model, tokenizer, prompts, args.new_tokens))):
                best[name] = [max(best[name][0], tokens / t.wall), max(best[name][1], tokens / t.cpu)]
        (ew, ec), (gw, gc) = best["engine"], best["generate"]
        print(f"{bs:>5} | {ew:>11.0f} {gw:>13.0f} {ew / gw:>5.2f} | {ec:>10.0f} {gc:>12.0f} {ec / gc:>5.2f}")
        rows.append({"batch": bs, "engine_tok_s": ew, "generate_tok_s": gw, "ratio_wall": ew / gw,
                     "engine_cpu_tok_s": ec, "generate_cpu_tok_s": gc})
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": args.device,
                                          "threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
                                          "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

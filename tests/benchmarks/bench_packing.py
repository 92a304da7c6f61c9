"""Time and peak memory of one update micro-batch, padded vs packed (``padding_free``), on the CPU
preset's shape with realistic padding.

    python tests/benchmarks/bench_packing.py [--rows 8] [--response 48] [--repeats 3] [--full-logits]

Model: the CPU preset's (tiny Qwen2, hidden 64, 2 layers, the Qwen2.5 vocabulary of 151,665
entries, fp32, sdpa attention, 1 thread). Rows: the CPU preset's micro-batch of 8 = 2 GSM8K
prompts x 4 samples, chat-templated with the shipped Qwen2.5 tokenizer and left-padded to the
longest of the step's 4 prompts (as the ``hf`` engine pads them); responses of lengths drawn
uniformly from ``[response/6, response]`` (seed 0), right-padded. Each path runs in a fresh
process: one warm-up, then ``--repeats`` measured forward + backward of the response log-probs
and entropies (the update), and as many no-grad forwards (the ``old_log_prob`` / ``ref`` stages);
medians are reported (wall, and the update's process CPU time, the fairer figure on a loaded
machine), with the process's peak RSS (``ru_maxrss``). Prints one JSON line per path.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def micro_batch(rows: int, response: int, vocab: int) -> dict:
    """The padded micro-batch (see the module docstring) and its padding figures."""
    import torch

    from rltrainer.data.datasets import GSM8K_INSTRUCTION
    from rltrainer.testing import data_path, load_tokenizer

    tokenizer = load_tokenizer("qwen2.5-instruct")
    prompts = []
    with open(data_path("gsm8k", "test.jsonl")) as f:
        for line in f:
            question = json.loads(line)["question"]
            messages = [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"][:256])
            if len(prompts) == 4:
                break
    P = max(len(p) for p in prompts)  # the step's longest prompt
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(rows, P + response, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(rows):
        prompt = prompts[row * 2 // rows]  # 2 prompts x rows/2 samples
        length = int(torch.randint(max(1, response // 6), response + 1, (1,), generator=g))
        ids[row, P - len(prompt):P] = torch.tensor(prompt)
        ids[row, P:P + length] = torch.randint(0, vocab, (length,), generator=g)
        mask[row, P - len(prompt):P + length] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
             "responses": ids[:, P:], "response_mask": mask[:, P:].clone()}
    return {"batch": batch, "prompt_width": P, "real_tokens": int(mask.sum()), "padded_tokens": mask.numel(),
            "response_tokens": int(batch["response_mask"].sum())}


def one(rows: int, response: int, packed: bool, chunked: bool, repeats: int) -> dict:
    import torch

    from rltrainer.models import build_causal_lm, response_log_probs
    from rltrainer.testing import tiny_qwen2_config

    torch.set_num_threads(1)
    vocab = 151_665
    data = micro_batch(rows, response, vocab)
    batch = data.pop("batch")
    model = build_causal_lm(tiny_qwen2_config(vocab, hidden_size=64), seed=0)
    mask = batch["response_mask"].float()
    kwargs = dict(chunk_tokens=None if chunked else 0, padding_free=packed)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    update, update_cpu, forward = [], [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        start, cpu = time.perf_counter(), time.process_time()
        log_probs, entropy = response_log_probs(model, batch, 0.9, with_entropy=True, entropy_grad=True, **kwargs)
        ((log_probs * mask).sum() + 0.01 * (entropy * mask).sum()).backward()
        update.append(time.perf_counter() - start)
        update_cpu.append(time.process_time() - cpu)
        start = time.perf_counter()
        with torch.no_grad():
            response_log_probs(model, batch, 0.9, **kwargs)
        forward.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"rows": rows, "packed": packed, "chunked_head": chunked, **data,
            "update_s": round(statistics.median(update[1:]), 3),
            "update_cpu_s": round(statistics.median(update_cpu[1:]), 3),
            "forward_s": round(statistics.median(forward[1:]), 3),
            "peak_rss_gb": round(peak, 3), "before_step_gb": round(before, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--response", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--full-logits", action="store_true", help="the full-logits LM head instead of the chunked one")
    p.add_argument("--one", type=int, choices=[0, 1], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.rows, args.response, bool(args.one), not args.full_logits, args.repeats)))
        return
    for packed in (0, 1):
        cmd = [sys.executable, __file__, "--one", str(packed), "--rows", str(args.rows), "--response",
               str(args.response), "--repeats", str(args.repeats)] + (["--full-logits"] if args.full_logits else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()

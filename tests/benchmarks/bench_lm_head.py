"""Peak memory and time of one update micro-batch (forward + backward of the response log-probs
and entropies) against micro-batch size, with the chunked LM head and with full logits.

    python tests/benchmarks/bench_lm_head.py [--rows 4 8 16 32] [--prompt 256] [--response 48]
    python tests/benchmarks/bench_lm_head.py --head full --rows 32 48 56 --passes 1     # the 8 GB search

``--head`` runs one path only; ``--passes 1`` times a single forward + backward (the peak is set by
the first), for the large sizes of the largest-micro-batch-in-8-GB search.

Model: the CPU preset's (tiny Qwen2, hidden 64, 2 layers) with the Qwen2.5 vocabulary (151,665
entries), fp32; each (rows, path) runs in a fresh process, whose peak RSS (``ru_maxrss``) is
reported with the process's size before the step. Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(rows: int, prompt: int, response: int, chunked: bool, hidden: int, passes: int = 2) -> dict:
    import torch

    from rltrainer.models import build_causal_lm, response_log_probs
    from rltrainer.testing import tiny_qwen2_config

    torch.set_num_threads(1)
    vocab = 151_665
    model = build_causal_lm(tiny_qwen2_config(vocab, hidden_size=hidden), seed=0)
    ids = torch.randint(0, vocab, (rows, prompt + response))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(prompt + response).expand(rows, -1), "responses": ids[:, prompt:]}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    times = []
    for _ in range(passes):  # the second is the steady state
        start = time.perf_counter()
        log_probs, entropy = response_log_probs(model, batch, 0.9, with_entropy=True, entropy_grad=True,
                                                chunk_tokens=None if chunked else 0)
        (log_probs.mean() + 0.01 * entropy.mean()).backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"rows": rows, "chunked": chunked, "peak_rss_gb": round(peak, 3), "before_step_gb": round(before, 3),
            "step_s": round(times[-1], 3), "user_s": round(usage.ru_utime, 2), "sys_s": round(usage.ru_stime, 2),
            "minor_faults": usage.ru_minflt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=48)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--head", choices=["both", "full", "chunked"], default="both")
    p.add_argument("--passes", type=int, default=2, help="forward + backward passes per run (the last is timed)")
    p.add_argument("--one", nargs=2, metavar=("ROWS", "CHUNKED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.prompt, args.response, args.one[1] == "1", args.hidden,
                             args.passes)))
        return
    heads = {"both": (False, True), "full": (False,), "chunked": (True,)}[args.head]
    for rows in args.rows:
        for chunked in heads:
            cmd = [sys.executable, __file__, "--one", str(rows), str(int(chunked)), "--prompt", str(args.prompt),
                   "--response", str(args.response), "--hidden", str(args.hidden), "--passes", str(args.passes)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            print(out.stdout.strip() or out.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()

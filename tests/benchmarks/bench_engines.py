"""Generation throughput of the ``hf`` and ``vllm`` engines on the same workload, on CPU.

Each engine is a replica in a Ray process of its own (as split placement runs them), holding the
same random-init tiny Qwen2 in fp32 (head size 32, as vLLM's CPU attention needs); both get the same
prompts (GSM8K questions with the shipped 4k BPE) and the same sampling, in alternating rounds so
that a load change on the machine hits both. Printed per engine: generated tokens per second of the
engine's own ``generate`` (``Generation.metrics["gen_time_s"]``) and of the controller's call
(Ray included), median over rounds, and the ratio vllm / hf measured in the same run.

    python tests/benchmarks/bench_engines.py                       # 16 prompts x 8 samples, 64 tokens
    python tests/benchmarks/bench_engines.py --hidden 256 --layers 4 --rounds 5 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each engine process")
    args = parser.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from rltrainer.controller.worker_group import RayWorkerGroup
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.models import build_causal_lm
    from rltrainer.rollout import HFEngine, SamplingParams, VLLMEngine
    from rltrainer.rollout.engine import ModelFiles
    from rltrainer.rollout.remote import RemoteEngine
    from rltrainer.rollout.worker import Worker
    from rltrainer.testing import data_path, load_tokenizer, tiny_qwen2_config

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    tokenizer = load_tokenizer("gsm8k-bpe4k")
    config = tiny_qwen2_config(len(tokenizer), hidden_size=args.hidden, num_layers=args.layers,
                               num_heads=args.hidden // 32, num_kv_heads=max(1, args.hidden // 64))
    policy = build_causal_lm(config, seed=0).eval()
    rows = load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(args.prompts))
    prompts = [list(r["prompt_ids"]) for r in prepare_gsm8k(rows, tokenizer, max_prompt_length=256)]
    sampling = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0, stop_token_ids=[])

    replicas = {}
    for name, engine in (("hf", HFEngine(dtype=torch.float32)), ("vllm", VLLMEngine(dtype=torch.float32))):
        group = RayWorkerGroup(Worker, 1, name=f"rollout-{name}", runtime_env=engine.runtime_env, threads=args.threads)
        group.execute_all("setup_engine", engine, ModelFiles.of(config, tokenizer))
        remote = RemoteEngine(group, tokenizer, torch.float32)
        remote.update_weights(policy.named_parameters())
        remote.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=8, stop_token_ids=[]))  # warm-up
        replicas[name] = (group, remote)
    engine_rates: dict[str, list[float]] = {name: [] for name in replicas}
    call_rates: dict[str, list[float]] = {name: [] for name in replicas}
    for _ in range(args.rounds):
        for name, (_, remote) in replicas.items():
            start = time.perf_counter()
            gen = remote.generate(prompts, sampling)
            wall = time.perf_counter() - start
            tokens = float(gen.response_mask.sum())
            engine_rates[name].append(tokens / gen.metrics["gen_time_s"])
            call_rates[name].append(tokens / wall)
    print(f"{args.prompts} prompts x {args.n} samples x {args.max_new_tokens} tokens, hidden {args.hidden}, "
          f"{args.layers} layers, fp32, {args.threads} thread(s) per engine, {args.rounds} rounds (median):")
    for name in replicas:
        print(f"  {name:5} engine {statistics.median(engine_rates[name]):9.0f} tok/s   "
              f"call {statistics.median(call_rates[name]):9.0f} tok/s")
    ratio = statistics.median(engine_rates["vllm"]) / statistics.median(engine_rates["hf"])
    print(f"  vllm / hf (engine): {ratio:.2f}x")
    for group, _ in replicas.values():
        group.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()

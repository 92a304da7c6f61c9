"""What only a GPU can check, one ``--check`` per run (gpu.sh runs them all, each with its budget):

- ``grpo`` (default): GRPO on one GPU: bf16 update-phase MFU, decode tokens/s, weight-sync GB/s
  next to a device-to-device copy of the same bytes. Needs torch and transformers only (plus
  tensordict, see gpu.sh); no Ray, no vLLM, no datasets.
- ``weight-group``: the weight-broadcast group (:class:`rltrainer.weights.group.WeightGroup`) on
  NCCL: a bucket in wire layout broadcast and read back bit-exact, with its GB/s. NCCL takes one
  GPU per member, so with one GPU the group has one member (its construction, SGLang's store
  layout, the broadcast and the shutdown on a real CUDA build); with two, trainer and receiver.
  On CPU: the same on gloo.
- ``update``: the update's forward + backward (response log-probs and entropies) over the same
  micro-batches four ways: the chunked LM head or full logits, padded rows or packed
  (``padding_free``), each with its MFU and peak memory. GSM8K prompts left-padded to the
  longest, responses of lengths drawn from ``[max_new_tokens/6, max_new_tokens]``, as a trained
  policy's vary. The FLOPs counted are the useful ones (real tokens only) in all four, so their
  MFUs compare as their speeds do.
- ``engines``: each engine of ``--engines`` (vLLM, SGLang where installed; ``hf`` anywhere) on a
  tiny random model: greedy with ``n > 1``, stop tokens honoured, seeds (equal prompts differ,
  a repeat reproduces), and ``sleep(1)`` / ``sleep(2)`` then a full update then generate, which must
  give the greedy output from before (the wake-up order, and ``weights_discarded`` at level 2).

    bash tests/benchmarks/gpu.sh                       # the lent H200: Qwen2.5-0.5B architecture, bf16
    python tests/benchmarks/bench_gpu.py --device cpu --model tiny --steps 2    # a smoke run anywhere
    python tests/benchmarks/bench_gpu.py --check weight-group --device cpu
    python tests/benchmarks/bench_gpu.py --check update --device cpu --model tiny --prompts 2 --group 2
    python tests/benchmarks/bench_gpu.py --check engines --engines hf --device cpu

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
import importlib.util
import json
import socket
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
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


def weight_group_check(device: torch.device, mib: int) -> dict:
    """Broadcast a ``mib`` MiB bucket (bf16 and fp32 tensors, wire layout) over a WeightGroup of
    one member per GPU (at most two; two threads on gloo for CPU) and read it back."""
    from rltrainer.weights.group import WeightGroup
    from rltrainer.weights.wire import bucket_entries, bucket_views, empty_bucket, flatten_bucket

    cuda = device.type == "cuda"
    members = min(torch.cuda.device_count(), 2) if cuda else 2
    backend = "nccl" if cuda else "gloo"
    n = mib * 2**20 // 6  # a bf16 and an fp32 tensor of n elements each
    tensors = {"w": torch.randn(n).to(torch.bfloat16), "b": torch.randn(n)}
    entries = bucket_entries((k, tuple(t.shape), t.dtype) for k, t in tensors.items())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    name = f"bench-{uuid.uuid4().hex[:8]}"

    def member(rank: int) -> tuple[float, bool]:
        here = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(here)
        group = WeightGroup("127.0.0.1", port, rank, members, name, backend, timeout_s=60)
        try:
            buffer = flatten_bucket(tensors, entries, here) if rank == 0 else empty_bucket(entries, here)
            group.broadcast(buffer)  # warm-up: NCCL sets up its channels on the first call
            trials, start = 5, time.perf_counter()
            for _ in range(trials):
                group.broadcast(buffer)
            seconds = (time.perf_counter() - start) / trials
            exact = all(torch.equal(v.cpu(), tensors[k]) for k, v in bucket_views(buffer, entries))
        finally:
            group.close()
        return seconds, exact

    with ThreadPoolExecutor(members) as pool:
        results = list(pool.map(member, range(members)))
    nbytes = int(sum(t.numel() * t.element_size() for t in tensors.values()))
    seconds = max(s for s, _ in results)
    return {"backend": backend, "members": members, "bytes": nbytes, "bit_exact": all(e for _, e in results),
            "gb_per_s": nbytes / seconds / 1e9 if members > 1 else None}


ENGINE_KWARGS = {"hf": {}, "vllm": {"gpu_memory_utilization": 0.3, "enforce_eager": True},
                 "sglang": {"mem_fraction_static": 0.3}}
DISCARDS_AT_LEVEL_2 = {"hf": False, "vllm": True, "sglang": True}  # hf moves its weights to CPU


def engine_check(name: str, device: torch.device) -> dict:
    """The issue-12 behaviours of one engine on a tiny random model; ``ok`` is whether all held
    (SGLang's seeds count only with deterministic inference, so they are reported, not required)."""
    import importlib.util

    from rltrainer.models import build_causal_lm
    from rltrainer.rollout import ENGINES, SamplingParams
    from rltrainer.testing import load_tokenizer, tiny_qwen2_config

    if name != "hf" and importlib.util.find_spec(name) is None:
        return {"engine": name, "skipped": f"{name} is not installed here (its wheels and their kernels are "
                                           "larger than what a run can carry)"}
    start = time.perf_counter()
    tokenizer = load_tokenizer("gsm8k-bpe4k")
    config = tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=2)
    model = build_causal_lm(config, seed=0).to(device)
    engine = ENGINES.build(name, **ENGINE_KWARGS[name])
    engine.setup(config, tokenizer, device=device)
    try:
        engine.update_weights(model.named_parameters())
        prompts = [tokenizer("What is 3 + 4?")["input_ids"], tokenizer("A robe takes 2 bolts")["input_ids"]]
        checks: dict = {}
        greedy = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=8, temperature=0.0))
        checks["greedy_n3_rows_equal"] = all(bool((greedy.response_ids[i * 3:i * 3 + 3] == greedy.response_ids[i * 3])
                                                  .all()) for i in range(2))
        free = engine.generate(prompts[:1], SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[]))
        stop = int(free.response_ids[0, 3])
        first = int((free.response_ids[0] == stop).nonzero()[0])
        stopped = engine.generate(prompts[:1], SamplingParams(max_new_tokens=16, temperature=0.0,
                                                              stop_token_ids=[stop, tokenizer.eos_token_id]))
        checks["runs_to_max_without_stop_tokens"] = free.finish_reason == ["length"] and \
            int(free.response_mask.sum()) == 16
        checks["stops_at_stop_token"] = stopped.finish_reason == ["stop"] and \
            int(stopped.response_mask.sum()) == first + 1
        seeded = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=1)
        a, b = engine.generate([prompts[0]] * 2, seeded), engine.generate([prompts[0]] * 2, seeded)
        seeds = {"seed_reproduces": torch.equal(a.response_ids, b.response_ids),
                 "equal_prompts_differ": not torch.equal(a.response_ids[:2], a.response_ids[2:])}
        if name == "sglang" and not ENGINE_KWARGS[name].get("engine_kwargs", {}).get("enable_deterministic_inference"):
            checks["seeds_without_deterministic_inference"] = seeds  # reported: SGLang ignores them
        else:
            checks.update(seeds)
        reference = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[]))
        for level in (1, 2):
            engine.sleep(level)
            checks[f"sleep{level}_weights_discarded_as_expected"] = \
                engine.weights_discarded == (level == 2 and DISCARDS_AT_LEVEL_2[name])
            engine.weights_discarded = False
            engine.update_weights(model.named_parameters())  # asleep, a full update: what the next sync sends
            engine.wake_up()  # as the pipeline does before a rollout
            again = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[]))
            checks[f"sleep{level}_update_generate_same_greedy"] = torch.equal(again.response_ids,
                                                                              reference.response_ids)
    finally:
        engine.teardown()
    required = [v for k, v in checks.items() if isinstance(v, bool)]
    return {"engine": name, "ok": all(required), "seconds": time.perf_counter() - start, **checks}


def run_checks(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if args.check == "weight-group":
        result = weight_group_check(device, args.mib)
        rate = f"{result['gb_per_s']:.1f} GB/s" if result["gb_per_s"] else "n/a (one member: one GPU)"
        print(f"weight group ({result['backend']}, {result['members']} members, {result['bytes'] / 2**20:.0f} MiB "
              f"bucket): bit-exact {result['bit_exact']}, broadcast {rate}")
        ok = result["bit_exact"]
    else:
        result = {"engines": [engine_check(name, device) for name in args.engines.split(",")]}
        for r in result["engines"]:
            print(f"engine {r['engine']}: " + (f"skipped ({r['skipped']})" if "skipped" in r else
                                               ", ".join(f"{k} {v}" for k, v in r.items() if k != "engine")))
        ok = all(r.get("ok", True) for r in result["engines"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    if not ok:
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", choices=["grpo", "update", "weight-group", "engines"], default="grpo")
    p.add_argument("--mib", type=int, default=256, help="weight-group: the bucket's size")
    p.add_argument("--engines", default="vllm,sglang", help="engines: which, comma-separated (hf, vllm, sglang)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=["0.5b", "tiny"], default="0.5b")
    p.add_argument("--strategy", choices=["single", "fsdp2", "megatron"], default="single",
                   help="megatron: megatron-core on one rank (bf16-true), its schedule and HF export")
    p.add_argument("--steps", type=int, default=5, help="GRPO steps (the first is a warm-up)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--out", default=None, help="where the JSON goes (grpo: tests/benchmarks/results/gpu.json)")
    args = p.parse_args()
    if args.check == "update":
        update_variants(args)
        return
    if args.check != "grpo":
        run_checks(args)
        return
    grpo(args)


def update_batch(tokenizer, prompts: int, group: int, max_new: int, vocab: int) -> dict:
    """``prompts x group`` rows: GSM8K prompts left-padded to the longest, responses of random
    tokens and lengths uniform in ``[max_new/6, max_new]`` (seed 0), right-padded."""
    rows = gsm8k_rows(tokenizer, prompts)
    width = max(len(r["prompt_ids"]) for r in rows)
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(prompts * group, width + max_new, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(prompts * group):
        prompt = rows[i // group]["prompt_ids"]
        length = int(torch.randint(max(1, max_new // 6), max_new + 1, (1,), generator=g))
        ids[i, width - len(prompt):width] = torch.tensor(prompt)
        ids[i, width:width + length] = torch.randint(0, vocab, (length,), generator=g)
        mask[i, width - len(prompt):width + length] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, width:], "response_mask": mask[:, width:].clone()}


def time_update(model: torch.nn.Module, micro: list, chunked: bool, device: torch.device) -> tuple[float, float | None]:
    """Median seconds of 2 passes (after a warm-up) of forward + backward over ``micro``, and the
    peak GiB allocated on CUDA (``None`` on CPU); bf16 autocast on CUDA."""
    from rltrainer.models import response_log_probs
    from rltrainer.strategies.strategy import autocast_context

    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    times = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        for mb in micro:
            with autocast_context(precision, device):
                log_probs, entropy = response_log_probs(model, mb, 1.0, with_entropy=True, entropy_grad=True,
                                                        chunk_tokens=None if chunked else 0)
            mask = mb["response_mask"].float()
            ((log_probs * mask).sum() + 0.01 * (entropy * mask).sum()).backward()
        sync(device)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return statistics.median(times[1:]), peak


def update_variants(args: argparse.Namespace) -> None:
    """The ``update`` check (see the module docstring): MFU with and without the chunked head and packing."""
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.models import build_causal_lm
    from rltrainer.strategies.strategy import form_micro_batches
    from rltrainer.testing import load_tokenizer

    device = torch.device(args.device)
    tokenizer = load_tokenizer("qwen2.5-instruct")
    config = model_config(args.model, len(tokenizer))
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        config._attn_implementation = "flash_attention_2"  # packed rows run varlen (cu_seq_lens)
    model = build_causal_lm(config, seed=0).to(device)  # fp32 master weights; bf16 autocast on CUDA
    params = sum(p.numel() for p in model.parameters())
    batch = RolloutBatch(update_batch(tokenizer, args.prompts, args.group, args.max_new_tokens, len(tokenizer)))
    lengths = batch["attention_mask"].sum(1).double()
    L, H = config.num_hidden_layers, config.hidden_size
    flops = 6 * params * float(lengths.sum()) + 12 * L * H * float((lengths**2).sum())  # useful work only
    results = []
    for chunked in (True, False):
        for packed in (False, True):
            micro = [mb.to(device) for mb in form_micro_batches(batch, args.micro_batch_size, None, packed)]
            variant = {"chunked_head": chunked, "packed": packed}
            try:
                seconds, peak = time_update(model, micro, chunked, device)
                results.append({**variant, "seconds": seconds, "mfu": flops / seconds / PEAK_BF16, "peak_gib": peak})
            except Exception as error:  # noqa: BLE001 (a variant out of memory or without its kernel: the others run)
                if device.type == "cpu":
                    raise
                model.zero_grad(set_to_none=True)
                results.append({**variant, "error": f"{type(error).__name__}: {error}"[:300]})
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "model": args.model,
              "params": params, "rows": len(batch), "micro_batch_size": args.micro_batch_size,
              "real_tokens": int(lengths.sum()), "padded_tokens": batch["attention_mask"].numel(),
              "attention": model.config._attn_implementation, "variants": results}
    out = Path(args.out or ROOT / "tests" / "benchmarks" / "results" / "gpu_update.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"update micro-batches: {len(batch)} rows x {args.micro_batch_size}, {result['real_tokens']:,} real of "
          f"{result['padded_tokens']:,} padded tokens, {params / 1e6:.0f}M params, attention {result['attention']}")
    for r in results:
        name = f"{'chunked head' if r['chunked_head'] else 'full logits'}, {'packed' if r['packed'] else 'padded'}"
        if "error" in r:
            print(f"  {name}: {r['error']}")
            continue
        memory = f", peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""
        print(f"  {name}: update MFU {r['mfu']:.1%} ({r['seconds']:.3f} s{memory})")
    print(f"wrote {out}")
    if not any("mfu" in r for r in results):
        sys.exit(1)


def grpo(args: argparse.Namespace) -> None:
    from rltrainer import GRPO, Callback, Trainer, prompt_dataloader
    from rltrainer.rollout.hf import HFEngine
    from rltrainer.strategies import FSDP2Strategy, SingleDeviceStrategy
    from rltrainer.testing import load_tokenizer

    args.out = args.out or str(ROOT / "tests" / "benchmarks" / "results" / "gpu.json")
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
    # a copy of its own (share_weights=False), so the sync is measured as the bytes it moves; beside the
    # single strategy in one dtype the engine would otherwise share the policy's storage and copy nothing
    engine = HFEngine(dtype=torch.bfloat16 if device.type == "cuda" else None, max_batch_size=512, share_weights=False)
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

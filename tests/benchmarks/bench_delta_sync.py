"""Delta weight sync (issue 34, items 5-6): how much of a bf16 engine's weights change per RL step,
what the diff scan costs against a copy, and delta vs full sync time and bytes on the wire, per
transport; then each transport's full-sync GB/s against this machine's memcpy. Prints tables and
writes ``tests/benchmarks/figures/delta_sync.json``.

    python tests/benchmarks/bench_delta_sync.py                    # all parts (about 25 min on 2 idle cores)
    python tests/benchmarks/bench_delta_sync.py --parts changes    # only the change shares and the scan cost

The model is the Qwen2.5-0.5B architecture (``bench_fsdp2.qwen25_05b_config``, random init, seed 0,
fp32 master weights, 494M parameters, 151,936-token tied vocabulary). Every step is GRPO's policy
loss (``GRPO(kl_coef=0)``: AdamW, weight decay 0.01, gradient clip 1.0) on ``--rows`` GSM8K train
prompts (the Qwen2.5 chat template) with their reference solutions as the responses and advantages
+1 / -1 alternating, so the gradient is that of the solutions' log-likelihood, half of it reversed:
real gradients of real text, no generation. The same seeded batches at every learning rate and in
every part.

``changes`` (in-process, ``single`` strategy, ``torch.set_num_threads(--threads)``): after a
warm-up step, per step, the share of the bf16 cast's elements (and of its bytes, compared byte by
byte) that differ from the previous step's cast: what a bf16 engine would be sent; overall, for the
embedding (tied with the LM head) and for the rest; the fp32 share for reference. Then, on the last
step's weights: the diff scan (``torch.ne`` of the casts viewed as int16, ``nonzero``, gather of
the values) and a checksum pass (``rltrainer.weights.delta.checksum``) over every tensor, against
``dst.copy_(src)`` of the same bytes, same process and threads.

``sync``: ``FSDP2Strategy(devices=1)`` and ``Rollout(placement="split")`` with one ``hf`` replica in bf16,
for each transport (``shared_memory``, ``object_store``) and learning rate with
``Rollout(delta=True)``, and at the ``--full-lrs`` (default: the first) with ``False`` too (a
full sync sends every trained tensor whatever the lr: one full run per transport is the
reference): a full first sync, the warm-up step and its sync, then per step ``train_step`` on the
same batches and a sync timed from the controller (the transport's ``start(version).wait()``, seconds included). Its stats: ``bytes`` (a full sync's), ``wire_bytes`` (sent), ``changed_share``,
``delta_buckets`` / ``full_buckets``, ``checksum_mismatches``, ``encode_s``, ``checksum_s``, ``seconds``.

``codec``: the delta codec alone, in one process (no transport): the sender's encode and
checksums and the receiver's apply and checksums over the model's bf16 weights in 256 MiB buckets
(random init; ``--codec-shares`` of the words changed at random positions; ``max_share=1``, so
every bucket is a delta), against ``copy_``; for each of ``--codecs``: the compiled one-pass kernels
(``rltrainer/weights/_kernels.py``, the CPU default) and the reference whole-array passes.

``line-rate``: ``bench_fsdp2.py sync``'s full sync (every tensor, fp32, FSDP2 x2) per placement
(colocated, shared memory, object store, gloo broadcast), with a 1-thread ``copy_`` of the same
bytes in the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fsdp2 import ROOT, qwen25_05b_config  # noqa: E402

LINE_RATE_PLACEMENTS = ("colocated", "split-shared-memory", "split-object-store", "split-broadcast")
EMBEDDING = "model.embed_tokens.weight"


def gsm8k_batches(tokenizer: Any, steps: int, rows: int, max_prompt: int, max_response: int, seed: int) -> list[Any]:
    """``steps`` batches of ``rows`` GSM8K train prompts with their reference solutions as responses
    (truncated to ``max_response`` tokens, EOS appended when it fits), advantages +1 / -1 alternating."""
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.testing import data_path

    data = prepare_gsm8k(load_rows(str(data_path("gsm8k", "train.jsonl"))), tokenizer, max_prompt_length=max_prompt)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:steps * rows].tolist()
    pad = tokenizer.pad_token_id
    batches = []
    for step in range(steps):
        picked = [data[i] for i in order[step * rows:(step + 1) * rows]]
        prompts = [row["prompt_ids"] for row in picked]
        responses = [(tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
                     [:max_response] for row in picked]
        P, T = max(map(len, prompts)), max(map(len, responses))
        prompt_ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])  # [N, P] left-padded
        response_ids = torch.tensor([r + [pad] * (T - len(r)) for r in responses])  # [N, T] right-padded
        response_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in responses])
        attention_mask = torch.cat([torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts]),
                                    response_mask], 1)
        signs = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(picked))])
        batch = RolloutBatch({"input_ids": torch.cat([prompt_ids, response_ids], 1), "attention_mask": attention_mask,
                              "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "responses": response_ids,
                              "response_mask": response_mask, "advantages": signs[:, None] * response_mask})
        batch.global_tokens, batch.global_rows = float(response_mask.sum()), float(len(picked))
        batches.append(batch)
    return batches


def grpo_module(tokenizer: Any, lr: float, max_response: int) -> Any:
    from rltrainer import GRPO

    return GRPO(qwen25_05b_config(151936), tokenizer, reward_funcs="gsm8k", kl_coef=0.0, lr=lr,
                max_new_tokens=max_response, model_seed=0)


# -- part A: what changes, and what a scan costs ----------------------------------------------------

def changed_counts(new: torch.Tensor, old: torch.Tensor) -> tuple[int, int]:
    """Elements and bytes of ``new`` that differ from ``old`` (same dtype and shape)."""
    elements = int(torch.ne(new.view(-1), old.view(-1)).sum()) if new.dtype != torch.bfloat16 else int(
        torch.ne(new.view(-1).view(torch.int16), old.view(-1).view(torch.int16)).sum())
    nbytes = int(torch.ne(new.reshape(-1).view(torch.uint8), old.reshape(-1).view(torch.uint8)).sum())
    return elements, nbytes


def share_row(counts: dict[str, tuple[int, int]], sizes: dict[str, int], element_size: int,
              names: list[str]) -> dict[str, float]:
    total = sum(sizes[n] for n in names)
    return {"elements": sum(counts[n][0] for n in names) / total,
            "bytes": sum(counts[n][1] for n in names) / (total * element_size)}


def step_shares(params: dict[str, torch.Tensor], old32: dict[str, torch.Tensor],
                old16: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The share of each group's bf16 cast (and fp32 values) that changed since ``old16`` / ``old32``;
    moves both to ``params``."""
    c16, c32, sizes = {}, {}, {}
    for name, p in params.items():
        new16 = p.to(torch.bfloat16)
        c16[name], c32[name], sizes[name] = changed_counts(new16, old16[name]), changed_counts(p, old32[name]), p.numel()
        old16[name].copy_(new16)
        old32[name].copy_(p)
    groups = {"all": list(params), "embedding": [n for n in params if n == EMBEDDING],
              "rest": [n for n in params if n != EMBEDDING]}
    return {"bf16": {g: share_row(c16, sizes, 2, names) for g, names in groups.items()},
            "fp32": {g: share_row(c32, sizes, 4, names) for g, names in groups.items()}}


def scan_costs(params: dict[str, torch.Tensor], old16: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    """Seconds per pass over every tensor (median of ``repeats``): ``copy_`` of the bf16 cast's bytes;
    the diff scan against ``old16`` as :class:`~rltrainer.weights.delta.DeltaEncoder` does it (int16
    words: ``ne``, ``nonzero``, gather of the values) and its parts; the same indices found through
    int64 blocks first (4 words: ``ne`` and ``nonzero`` on a quarter of the elements, then the changed
    blocks' words); a checksum of each tensor (``rltrainer.weights.delta.checksum``); the fp32 -> bf16
    cast itself for reference."""
    from rltrainer.weights.delta import checksum

    new16 = {n: p.to(torch.bfloat16).view(-1).view(torch.int16) for n, p in params.items()}
    old = {n: t.view(-1).view(torch.int16) for n, t in old16.items()}
    dst = {n: torch.zeros_like(t) for n, t in new16.items()}  # faulted in, as the engine's tensors are
    lanes = torch.arange(4)

    def copy() -> None:
        for name, new in new16.items():
            dst[name].copy_(new)

    def ne() -> None:
        for name, new in new16.items():
            torch.ne(new, old[name])

    def ne_nonzero() -> None:
        for name, new in new16.items():
            torch.ne(new, old[name]).nonzero()

    def scan() -> int:
        changed = 0
        for name, new in new16.items():
            idx = torch.ne(new, old[name]).nonzero().view(-1)
            changed += new[idx].numel()
        return changed

    def blocks() -> int:
        changed = 0
        for name, new in new16.items():
            if new.numel() % 4:
                idx = torch.ne(new, old[name]).nonzero().view(-1)
            else:
                hit = torch.ne(new.view(torch.int64), old[name].view(torch.int64)).nonzero().view(-1, 1)
                words = (hit * 4 + lanes).view(-1)
                idx = words[new[words] != old[name][words]]
            changed += new[idx].numel()
        return changed

    def sums() -> None:
        for new in new16.values():
            checksum(new)

    def cast() -> None:
        for p in params.values():
            p.to(torch.bfloat16)

    changed = scan()
    assert blocks() == changed, "the int64-block scan finds the same words"
    out: dict[str, Any] = {"bytes": sum(t.numel() * 2 for t in new16.values()), "changed_words": changed}
    passes = {"copy_s": copy, "ne_s": ne, "ne_nonzero_s": ne_nonzero, "scan_s": scan, "block_scan_s": blocks,
              "checksum_s": sums, "cast_s": cast}
    for what, fn in passes.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[what] = statistics.median(times)
        out[what + "_trials"] = times
    for what in passes:
        out[what[:-2] + "_vs_copy"] = out[what] / out["copy_s"]
    out["copy_gb_per_s"] = out["bytes"] / out["copy_s"] / 1e9
    return out


def bench_changes(args: argparse.Namespace, tokenizer: Any, batches: list[Any]) -> dict[str, Any]:
    from rltrainer.strategies import SingleDeviceStrategy

    torch.set_num_threads(args.threads)
    out = {}
    for lr in args.lrs:
        strategy = SingleDeviceStrategy(device="cpu", micro_batch_size=args.rows)
        strategy.setup(grpo_module(tokenizer, lr, args.max_response), seed=0)
        params = {n: p.detach() for n, p in strategy.module.policy.named_parameters()}
        old32 = {n: p.clone() for n, p in params.items()}
        old16 = {n: p.to(torch.bfloat16) for n, p in params.items()}
        steps = []
        for i, batch in enumerate(batches):
            start = time.perf_counter()
            metrics = strategy.train_step(batch)
            train_s = time.perf_counter() - start
            shares = step_shares(params, old32, old16)
            steps.append({"step": i, "warmup": i == 0, "train_s": train_s, "grad_norm": metrics.get("actor/grad_norm"),
                          **shares})
            print(f"lr {lr:g} step {i}{' (warm-up)' if i == 0 else ''}: train {train_s:.1f} s, bf16 changed "
                  f"{shares['bf16']['all']['elements']:.2%} of elements (embedding "
                  f"{shares['bf16']['embedding']['elements']:.2%}, rest {shares['bf16']['rest']['elements']:.2%}), "
                  f"fp32 {shares['fp32']['all']['elements']:.2%}", flush=True)
        # the last step once more for the scan: old16 is the cast before it, params after it
        old16 = {n: t.clone() for n, t in old16.items()}
        strategy.train_step(batches[-1])
        out[f"{lr:g}"] = {"steps": steps, "scan": scan_costs(params, old16, args.repeats)}
        del strategy, params, old32, old16
    return out


# -- part B: delta vs full through the strategy ----------------------------------------------------

def bench_sync_modes(args: argparse.Namespace) -> dict[str, Any]:
    """Every (transport, lr, mode) run, each in a process of its own (with one rank, the FSDP2 rank
    runs in that process, and a torn-down run's memory is not the next one's)."""
    out: dict[str, Any] = {}
    spawn = multiprocessing.get_context("spawn")
    for transport in args.transports:
        for lr in args.lrs:
            for delta in (False, True) if lr in args.full_lrs else (True,):
                key = f"{transport}/{lr:g}/{'delta' if delta else 'full'}"
                path = Path(tempfile.gettempdir()) / f"bench_delta_sync_run_{os.getpid()}.json"
                proc = spawn.Process(target=sync_run, args=(args, transport, lr, delta, key, str(path)))
                proc.start()
                proc.join()
                if proc.exitcode:
                    raise RuntimeError(f"sync run {key} failed (exit code {proc.exitcode})")
                out[key] = json.loads(path.read_text())
                path.unlink()
    return out


def sync_run(args: argparse.Namespace, transport: str, lr: float, delta: bool, key: str, path: str) -> None:
    """One strategy: a full first sync, then per batch ``train_step`` and a timed sync; JSON in ``path``."""
    import ray

    from rltrainer.rollout.hf import HFEngine
    from rltrainer.rollout.rollout import Rollout
    from rltrainer.strategies import FSDP2Strategy
    from rltrainer.testing import load_tokenizer

    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tokenizer = load_tokenizer("qwen2.5-instruct")
    batches = gsm8k_batches(tokenizer, 1 + args.sync_steps, args.rows, args.max_prompt, args.max_response, seed=0)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    strategy = FSDP2Strategy(devices=1, micro_batch_size=args.rows, threads_per_worker=args.threads)
    rollout = Rollout(HFEngine(dtype=torch.bfloat16), placement="split", transport=transport, delta=delta,
                      bucket_bytes=args.bucket_mb << 20)
    try:
        strategy.setup(grpo_module(tokenizer, lr, args.max_response), seed=0)
        sync = rollout.connect(strategy, tokenizer)
        first = sync.transport.start(0).wait()  # in full: the engine has nothing yet
        steps = []
        for i, batch in enumerate(batches):
            start = time.perf_counter()
            strategy.train_step(batch)
            train_s = time.perf_counter() - start
            stats = sync.transport.start(i + 1).wait()
            steps.append({"step": i, "warmup": i == 0, "train_s": train_s, "load": os.getloadavg()[0], **stats})
            print(f"{key} step {i}: sync {stats['seconds']:.2f} s, wire {stats.get('wire_bytes', stats['bytes']) / 1e6:.0f} "
                  f"of {stats['bytes'] / 1e6:.0f} MB, changed {stats.get('changed_share', float('nan')):.2%}, "
                  f"mismatches {stats.get('checksum_mismatches', '-')}", flush=True)
    finally:
        rollout.teardown()
        strategy.teardown()
        ray.shutdown()
    Path(path).write_text(json.dumps({"first": first, "steps": steps}))


def summarize_sync(runs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Per transport and lr: median changed share, wire / full bytes, delta time / full time (steps after the warm-up)."""
    summary = {}
    for transport in args.transports:
        for lr in args.lrs:
            full_lr = lr if lr in args.full_lrs else args.full_lrs[0]  # a full sync's bytes do not depend on the lr
            full = [s for s in runs[f"{transport}/{full_lr:g}/full"]["steps"] if not s["warmup"]]
            delta = [s for s in runs[f"{transport}/{lr:g}/delta"]["steps"] if not s["warmup"]]
            med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
            summary[f"{transport}/{lr:g}"] = {
                "changed_share": med(delta, "changed_share"), "wire_share": med(delta, "wire_share"),
                "full_s": med(full, "seconds"), "delta_s": med(delta, "seconds"),
                "time_ratio": med(delta, "seconds") / med(full, "seconds"), "full_lr": full_lr,
                "encode_s": med(delta, "encode_s"), "checksum_s": med(delta, "checksum_s"),
                "apply_s": med(delta, "apply_s"), "verify_s": med(delta, "verify_s"),
                "delta_s_each": [r["seconds"] for r in delta], "full_s_each": [r["seconds"] for r in full],
                "delta_mean_s": statistics.mean(r["seconds"] for r in delta),
                "delta_buckets": med(delta, "delta_buckets"), "full_buckets": med(delta, "full_buckets"),
                "checksum_mismatches": sum(r["checksum_mismatches"] for r in delta), "bytes": med(full, "bytes")}
    return summary


# -- the codec alone: where a delta sync's time goes ------------------------------------------------

def bench_codec(args: argparse.Namespace) -> dict[str, Any]:
    """Per pass over the model's bf16 weights in ``--bucket-mb`` buckets (median of ``--repeats``), at
    each ``--codec-shares`` share of changed words (at random positions, +1 in the int16 view): the
    sender's :meth:`DeltaEncoder.encode <rltrainer.weights.delta.DeltaEncoder.encode>` (scan, gather,
    payload; and its checksums), a full bucket's :func:`~rltrainer.weights.wire.flatten_bucket` (what
    a full sync's sender does), the receiver's :meth:`DeltaDecoder.apply
    <rltrainer.weights.delta.DeltaDecoder.apply>` into an engine that lends its tensors (the ``hf``
    engine's path), without and with its checksums, and ``copy_`` of the same bytes."""
    import dataclasses

    from rltrainer.models import build_causal_lm
    from rltrainer.weights.delta import DeltaDecoder, DeltaEncoder, DeltaSync
    from rltrainer.weights.wire import bucket_by_bytes, flatten_bucket

    model = build_causal_lm(qwen25_05b_config(151936), seed=0)
    base = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    del model
    buckets = [[(n, "bfloat16", tuple(base[n].shape)) for n in names]
               for names in bucket_by_bytes(list(base), lambda n: base[n].numel() * 2, args.bucket_mb << 20)]

    class Engine:  # lends its tensors, as the hf engine does
        def __init__(self) -> None:
            self.tensors = {n: t.clone() for n, t in base.items()}

        def weight_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
            return {n: self.tensors[n] for n in names}

        def update_weights(self, views: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in views:
                self.tensors[name].copy_(tensor)

    from rltrainer.weights import _kernels

    out: dict[str, Any] = {"bytes": sum(t.numel() * 2 for t in base.values()), "buckets": len(buckets)}
    generator = torch.Generator().manual_seed(0)
    for impl, share in [(impl, share) for impl in args.codecs for share in args.codec_shares]:
        _kernels.ENABLED = impl == "compiled"
        moved = {}
        for name, t in base.items():
            words = t.view(-1).view(torch.int16).clone()
            hit = torch.rand(words.numel(), generator=generator) < share
            words[hit] += 1
            moved[name] = words.view(torch.bfloat16).view(t.shape)
        encoder, decoder, engine = DeltaEncoder(DeltaSync(max_share=1.0)), DeltaDecoder(), Engine()  # always a delta
        checked = Engine()  # a second replica: a delta applies once (its steps add to what the engine holds)
        encoder.begin_sync(list(base))
        rss = _rss()
        for entries in buckets:  # the base: what the engine holds
            encoder.encode(base, entries)
        out.setdefault("base_rss_bytes", _rss() - rss)  # the resident memory the base took (first pass)
        out.setdefault("base_nbytes", encoder.nbytes)
        dst = {n: torch.zeros_like(t) for n, t in base.items()}
        times: dict[str, list[float]] = {k: [] for k in ("encode_s", "sender_checksum_s", "flatten_s", "apply_s",
                                                          "apply_checksum_s", "copy_s")}
        wire = changed = 0
        for trial in range(2 * args.repeats):  # there and back: every pass changes the same number of words
            state = moved if trial % 2 == 0 else base
            encoder.begin_sync([])
            totals = dict.fromkeys(times, 0.0)
            wire = changed = 0
            for entries in buckets:
                payload, encoding = encoder.encode(state, entries)
                totals["encode_s"] += encoding.encode_s
                totals["sender_checksum_s"] += encoding.checksum_s
                wire, changed = wire + encoding.nbytes, changed + encoding.changed
                start = time.perf_counter()
                assert decoder.apply(engine, payload, entries, dataclasses.replace(encoding, checksums=()))
                totals["apply_s"] += time.perf_counter() - start
                start = time.perf_counter()
                assert decoder.apply(checked, payload, entries, encoding)  # the same scatter, then checked
                totals["apply_checksum_s"] += time.perf_counter() - start
                start = time.perf_counter()
                flatten_bucket(state, entries, "cpu")
                totals["flatten_s"] += time.perf_counter() - start
                start = time.perf_counter()
                for name, _, _ in entries:
                    dst[name].copy_(state[name])
                totals["copy_s"] += time.perf_counter() - start
            for key, value in totals.items():
                times[key].append(value)
        row = {key: statistics.median(values) for key, values in times.items()}
        row.update(trials=times, wire_share=wire / out["bytes"], changed_share=changed / (out["bytes"] // 2),
                   **{k[:-2] + "_vs_copy": v / row["copy_s"] for k, v in row.items() if k.endswith("_s")})
        out[f"{impl}/{share:g}"] = row
    _kernels.ENABLED = True
    return out


def _rss() -> int:
    """This process's resident memory, bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# -- the line-rate table: bench_fsdp2.py sync per placement -----------------------------------------

def bench_line_rate(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for placement in LINE_RATE_PLACEMENTS:
        path = ROOT / "tests" / "benchmarks" / "results" / f"delta_line_rate_{placement}.json"
        cmd = [sys.executable, str(ROOT / "tests" / "benchmarks" / "bench_fsdp2.py"), "sync", "--placement", placement,
               "--trials", str(args.line_rate_trials), "--out", str(path)]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        out[placement] = json.loads(path.read_text())
    return out


# -- report ----------------------------------------------------------------------------------------

def print_report(result: dict[str, Any]) -> None:
    if "changes" in result:
        print("\nShare of the bf16 cast that changed per step (median of the steps after the warm-up; min-max)")
        print(f"{'lr':>7} {'group':10} {'elements':>16} {'bytes':>16} {'fp32 elements':>16}")
        for lr, run in result["changes"].items():
            steps = [s for s in run["steps"] if not s["warmup"]]
            for group in ("all", "embedding", "rest"):
                cells = []
                for dtype, unit in (("bf16", "elements"), ("bf16", "bytes"), ("fp32", "elements")):
                    values = [s[dtype][group][unit] for s in steps]
                    cells.append(f"{statistics.median(values):.3%} ({min(values):.2%}-{max(values):.2%})")
                print(f"{lr:>7} {group:10} " + " ".join(f"{c:>16}" for c in cells))
        print("\nA pass over the bf16 model (int16 words), seconds and x copy_ of the same bytes, same threads")
        cols = ("copy", "ne", "ne_nonzero", "scan", "block_scan", "checksum", "cast")
        print(f"{'lr':>7} {'MB':>5} {'changed':>8} " + " ".join(f"{c:>15}" for c in cols) + f" {'copy GB/s':>10}")
        for lr, run in result["changes"].items():
            s = run["scan"]
            cells = [f"{s[c + '_s']:.3f} ({s[c + '_vs_copy']:.1f}x)" for c in cols]
            print(f"{lr:>7} {s['bytes'] / 1e6:>5.0f} {s['changed_words'] / (s['bytes'] / 2):>8.3%} "
                  + " ".join(f"{c:>15}" for c in cells) + f" {s['copy_gb_per_s']:>10.2f}")
    if "sync_summary" in result:
        print("\nDelta vs full sync, split placement, one bf16 hf replica (median of the steps after the warm-up)")
        print(f"{'transport/lr':22} {'changed':>8} {'wire/full':>10} {'full s':>8} {'delta s':>8} {'ratio':>6} "
              f"{'encode s':>9} {'checksum s':>11} {'delta/full buckets':>19} {'mismatches':>11}")
        for key, s in result["sync_summary"].items():
            print(f"{key:22} {s['changed_share']:>8.3%} {s['wire_share']:>10.3%} {s['full_s']:>8.3f} {s['delta_s']:>8.3f} "
                  f"{s['time_ratio']:>6.2f} {s['encode_s']:>9.3f} {s['checksum_s']:>11.3f} "
                  f"{s['delta_buckets']:>9.0f}/{s['full_buckets']:<9.0f} {s['checksum_mismatches']:>11}")
    if "codec" in result:
        c = result["codec"]
        print(f"\nThe delta codec alone, one pass over the bf16 model ({c['bytes'] / 1e6:.0f} MB, {c['buckets']} buckets), "
              "seconds and x copy_ of the same bytes")
        cols = ("copy", "flatten", "encode", "sender_checksum", "apply", "apply_checksum")
        print(f"{'codec':>9} {'changed':>8} {'wire':>7} " + " ".join(f"{col:>16}" for col in cols))
        for key in [k for k in c if "/" in k]:
            r = c[key]
            print(f"{key.split('/')[0]:>9} {r['changed_share']:>8.2%} {r['wire_share']:>7.2%} "
                  + " ".join(f"{r[col + '_s']:>9.3f} ({r[col + '_vs_copy']:>4.1f}x)" for col in cols))
    if "line_rate" in result:
        print("\nFull sync (fp32, every tensor, FSDP2 x2) vs a 1-thread copy_ of the same bytes, same run")
        print(f"{'placement':22} {'GB/s':>7} {'copy GB/s':>10} {'ratio':>6}")
        for placement, r in result["line_rate"].items():
            print(f"{placement:22} {r['sync_median']:>7.2f} {r['copy_median']:>10.2f} {r['ratio']:>6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=["changes", "sync", "codec", "line-rate"],
                   default=["changes", "sync", "codec", "line-rate"])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--steps", type=int, default=3, help="measured steps per lr, after one warm-up step (changes)")
    p.add_argument("--sync-steps", type=int, default=2, help="measured steps per lr and mode, after one warm-up (sync)")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--max-prompt", type=int, default=128, help="drop longer prompts (tokens)")
    p.add_argument("--max-response", type=int, default=64, help="truncate the solutions (tokens)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="trials of each scan / copy / checksum pass")
    p.add_argument("--full-lrs", type=float, nargs="+", default=None,
                   help="sync: the lrs that also run delta=False (default: the first): a full sync sends "
                        "every trained tensor whatever the lr, so one full run per transport is the reference")
    p.add_argument("--codecs", nargs="+", choices=["compiled", "reference"], default=["compiled", "reference"],
                   help="codec: the compiled one-pass kernels (numba, the CPU default) and the reference passes")
    p.add_argument("--codec-shares", type=float, nargs="+", default=[0.001, 0.02, 0.14],
                   help="codec: shares of changed words (the changes part measured 2.0-2.8%% at lr 1e-6, 13-17%% at 1e-5)")
    p.add_argument("--transports", nargs="+", default=["shared_memory", "object_store"])
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--line-rate-trials", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "tests" / "benchmarks" / "figures" / "delta_sync.json"))
    args = p.parse_args()
    args.full_lrs = args.full_lrs or args.lrs[:1]
    if not set(args.full_lrs) <= set(args.lrs):
        p.error(f"--full-lrs {args.full_lrs} must be among --lrs {args.lrs}")

    out = Path(args.out)  # the parts not run keep their figures from the file (each part has its date)
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    result.update(args=vars(args), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  torch=torch.__version__, cpus=os.cpu_count())
    start = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    for part in args.parts:  # each in a process of its own: a part's memory is not the next one's
        path = Path(tempfile.gettempdir()) / f"bench_delta_sync_{part}_{os.getpid()}.json"
        proc = spawn.Process(target=run_part, args=(args, part, str(path)))
        proc.start()
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"part {part!r} failed (exit code {proc.exitcode})")
        result.update(json.loads(path.read_text()))
        path.unlink()
        result["wall_s"] = time.perf_counter() - start  # written after each part: a later failure keeps these
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    print_report(result)
    print(f"wrote {out} ({result['wall_s']:.0f} s)")


def run_part(args: argparse.Namespace, part: str, path: str) -> None:
    """One part's figures, with its own wall time and load, as JSON in ``path``."""
    from rltrainer.testing import load_tokenizer

    torch.set_num_threads(args.threads)
    start, load = time.perf_counter(), os.getloadavg()
    if part == "line-rate":
        figures: dict[str, Any] = {"line_rate": bench_line_rate(args)}
    elif part == "codec":
        figures = {"codec": bench_codec(args)}
    else:
        tokenizer = load_tokenizer("qwen2.5-instruct")
        steps = 1 + (args.steps if part == "changes" else args.sync_steps)
        batches = gsm8k_batches(tokenizer, steps, args.rows, args.max_prompt, args.max_response, seed=0)
        if part == "changes":
            figures = {"changes": bench_changes(args, tokenizer, batches)}
        else:
            runs = bench_sync_modes(args)
            figures = {"sync": runs, "sync_summary": summarize_sync(runs, args)}
        figures["tokens_per_batch"] = [int(b["attention_mask"].sum()) for b in batches]
    figures[f"{part}_run"] = {"wall_s": time.perf_counter() - start, "load_before": load, "load_after": os.getloadavg(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(path).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

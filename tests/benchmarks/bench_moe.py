"""Mixture-of-experts on CPU: which experts implementation is fastest, and what a GRPO step of a MoE
policy costs against dense models, each measured against its baseline in the same run.

``experts``: transformers' three experts implementations (``config._experts_implementation``:
``eager``, a Python loop over the experts hit; ``batched_mm``, each token's expert weights gathered
and multiplied in one ``bmm``; ``grouped_mm``, the tokens sorted by expert and one grouped GEMM,
transformers 5's default) on a forward + backward of a stack of two Qwen3-MoE blocks (router and
experts) over random hidden states, fp32 and bf16, at a few sizes. The three run in turn, repeat
after repeat, and the median is printed with its ratio to ``grouped_mm``'s; the first block's
output is compared too (the largest difference to ``eager``'s, relative to its largest value). ``batched_mm`` holds a copy of every routed
token's expert weights (and its gradient), so a size where that passes ``--batched-mm-gb`` is
skipped. Also printed: the implementation rltrainer's policy gets (``build_causal_lm``, from a
config and from a saved checkpoint).

``step``: a GRPO update on the ``single`` strategy of a tiny Qwen3-MoE (8 experts, top-2, routing
replay on: the rows carry the ``hf`` engine's routes) against two dense Qwen3 models with the same
attention, one with the MoE's *active* parameters per token (an MLP ``K x I`` wide) and one with its
*total* parameters (``E x I`` wide), on the same rows: ``policy_step``'s forward + backward
(``rltrainer.models.response_log_probs``, the GRPO loss) and ``Strategy.train_step`` (every
micro-batch and the optimizer step). Medians (and minima: the runs least disturbed by other jobs) of
``--repeats`` alternating runs, in seconds; ratios to the active-parameter dense model.

    python tests/benchmarks/bench_moe.py experts [--threads 1] [--repeats 5]
    python tests/benchmarks/bench_moe.py step [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
#: (experts E, experts per token K, hidden H, expert width I, tokens): the recipe's MoE on one
#: update micro-batch (64 rows x 13 tokens), then sizes of real MoE layers scaled to a CPU.
SIZES = ((8, 2, 64, 128, 832), (8, 2, 256, 512, 512), (8, 2, 512, 1024, 2048), (32, 4, 256, 512, 2048),
         (64, 8, 512, 256, 2048))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# -- experts implementations ---------------------------------------------------------------------------
class Residual(torch.nn.Module):
    """``x + block(x)``, as a decoder layer adds its MLP's output."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


def moe_stack(experts: int, top_k: int, hidden: int, width: int, layers: int, dtype: torch.dtype) -> Any:
    """``layers`` Qwen3-MoE blocks (router + experts) on a residual stream, weights drawn as
    transformers draws them (std 0.02)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=width, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True)
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*[Residual(Qwen3MoeSparseMoeBlock(config)) for _ in range(layers)])
    for p in stack.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return stack.to(dtype), config


def forward_backward(stack: torch.nn.Module, hidden: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Seconds of one forward + backward, and the first MoE block's output (the same input for every
    implementation; on the residual stream a bf16 sum would round most of it away)."""
    stack.zero_grad(set_to_none=True)
    first: list[torch.Tensor] = []
    hook = stack[0].block.register_forward_hook(lambda module, args, out: first.append(out.detach()))
    x = hidden.clone().requires_grad_(True)
    try:
        start = time.perf_counter()
        stack(x).float().pow(2).mean().backward()
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    return seconds, first[0]


def bench_experts(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for experts, top_k, hidden, width, tokens in SIZES:
        for dtype_name, dtype in DTYPES.items():
            stack, config = moe_stack(experts, top_k, hidden, width, args.layers, dtype)
            x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
            itemsize = torch.finfo(dtype).bits // 8
            gathered_gb = 2 * tokens * top_k * 3 * width * hidden * itemsize / 1e9  # the copies and their gradients
            impls = [i for i in IMPLEMENTATIONS if i != "batched_mm" or gathered_gb <= args.batched_mm_gb]
            times: dict[str, list[float]] = {i: [] for i in impls}
            outputs: dict[str, torch.Tensor] = {}
            for repeat in range(args.repeats + 1):  # the first round warms up
                for impl in impls:
                    config._experts_implementation = impl
                    seconds, outputs[impl] = forward_backward(stack, x)
                    if repeat:
                        times[impl].append(seconds)
            median = {i: statistics.median(t) for i, t in times.items()}
            row = {"experts": experts, "top_k": top_k, "hidden": hidden, "width": width, "tokens": tokens,
                   "dtype": dtype_name, "seconds": median,
                   "vs_grouped_mm": {i: median[i] / median["grouped_mm"] for i in impls},
                   "max_rel_diff_to_eager": {i: float((outputs[i].float() - outputs["eager"].float()).abs().max()
                                                    / outputs["eager"].float().abs().max()) for i in impls},
                   "skipped": [] if "batched_mm" in impls else [f"batched_mm (would gather {gathered_gb:.1f} GB)"]}
            rows.append(row)
            cells = "  ".join(f"{i} {1e3 * median[i]:8.1f} ms ({row['vs_grouped_mm'][i]:.2f}x, "
                              f"{row['max_rel_diff_to_eager'][i]:.0e})" for i in impls)
            print(f"E{experts:<3} K{top_k} H{hidden:<4} I{width:<5} {tokens:5d} tokens {dtype_name}: {cells}"
                  + (f"  [{row['skipped'][0]}]" if row["skipped"] else ""), flush=True)
    return rows


def policy_implementation() -> dict[str, str]:
    """The experts implementation of the policy rltrainer builds: from a config, and from a checkpoint."""
    import tempfile

    from rltrainer.models import build_causal_lm
    from rltrainer.testing.families import tiny_moe_config

    model = build_causal_lm(tiny_moe_config(64), seed=0)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = build_causal_lm(folder)
    return {"from a config": model.config._experts_implementation,
            "from a checkpoint": loaded.config._experts_implementation}


# -- a GRPO step: MoE against dense --------------------------------------------------------------------
def step_models(vocab: int, hidden: int, layers: int) -> dict[str, Any]:
    """The MoE (8 experts of width 2H, top-2) and the two dense Qwen3 baselines, same attention."""
    from rltrainer.testing.families import tiny_config, tiny_moe_config

    experts, top_k, width = 8, 2, 2 * hidden
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=hidden // 4, max_position_embeddings=512)
    return {"moe": tiny_moe_config(vocab, moe_intermediate_size=width, num_experts=experts,
                                   num_experts_per_tok=top_k, **common),
            "dense, active": tiny_config("qwen3", vocab, intermediate_size=top_k * width, **common),
            "dense, total": tiny_config("qwen3", vocab, intermediate_size=experts * width, **common)}


def prepared(config: Any, tokenizer: Any, prompts: Any, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """A GRPO module on ``single``, and one step's rows as the loop lays them out (the ``hf`` engine
    records the routes of a MoE policy, as the Trainer has it do)."""
    from rltrainer import GRPO
    from rltrainer.strategies import SingleDeviceStrategy
    from rltrainer.testing import length_reward, prepared_batch

    module = GRPO(config, tokenizer, reward_funcs=length_reward, num_generations=args.group_size,
                  max_new_tokens=args.max_new_tokens, lr=1e-6, mini_batch_size=len(prompts) * args.group_size)
    strategy = SingleDeviceStrategy(device="cpu", micro_batch_size=args.micro_batch_size)
    strategy.setup(module, seed=0)
    return module, strategy, prepared_batch(module, strategy, prompts)


def policy_step_seconds(module: Any, strategy: Any, batch: Any) -> float:
    """One ``policy_step`` forward + backward over the step's micro-batches (no optimizer step)."""
    module.policy.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for micro_batch in strategy.micro_batches(batch):
        loss, _ = module.policy_step(micro_batch)
        loss.backward()
    return time.perf_counter() - start


def bench_step(args: argparse.Namespace) -> list[dict[str, Any]]:
    from rltrainer import RolloutBatch
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.testing import data_path, load_tokenizer

    tokenizer = load_tokenizer("gsm8k-bpe4k")
    rows = load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(args.prompts))
    prompts = RolloutBatch.from_rows(prepare_gsm8k(rows, tokenizer, max_prompt_length=args.max_prompt_length))
    out = []
    for hidden, layers in args.model_sizes:
        runs = {name: prepared(config, tokenizer, prompts, args) for name, config in
                step_models(len(tokenizer), hidden, layers).items()}
        batch = runs["moe"][2]  # every model trains on the MoE's rows (the dense ones without its routes)
        batches = {name: batch if name == "moe" else batch.select(*[k for k in batch.keys() if k != "routed_experts"])
                   for name in runs}
        params = {name: sum(p.numel() for p in m.policy.parameters()) for name, (m, _, _) in runs.items()}
        policy: dict[str, list[float]] = {name: [] for name in runs}
        train: dict[str, list[float]] = {name: [] for name in runs}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, (module, strategy, _) in runs.items():
                seconds = policy_step_seconds(module, strategy, batches[name])
                start = time.perf_counter()
                strategy.train_step(batches[name])
                if repeat:
                    policy[name].append(seconds)
                    train[name].append(time.perf_counter() - start)
        tokens = int(batch["attention_mask"].sum())
        for name in runs:
            row = {"hidden": hidden, "layers": layers, "model": name, "parameters": params[name],
                   "rows": len(batch), "tokens": tokens, "routes": "routed_experts" in batches[name],
                   "policy_step": statistics.median(policy[name]), "train_step": statistics.median(train[name]),
                   "policy_step_min": min(policy[name]), "train_step_min": min(train[name])}
            out.append(row)
        base = out[-len(runs):][1]  # 'dense, active'
        print(f"\nhidden {hidden}, {layers} layers, {len(batch)} rows, {tokens} tokens; median (min) seconds, "
              "and their ratios to 'dense, active':")
        for row in out[-len(runs):]:
            cells = [f"{what} {row[k]:.3f} ({row[k + '_min']:.3f}) s, {row[k] / base[k]:.2f}x "
                     f"({row[k + '_min'] / base[k + '_min']:.2f}x)"
                     for what, k in (("policy_step fwd+bwd", "policy_step"), ("train_step", "train_step"))]
            print(f"  {row['model']:14s} {row['parameters'] / 1e6:6.2f}M parameters  " + "  ".join(cells), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["experts", "step", "both"], nargs="?", default="both")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2, help="experts: MoE blocks in the stack")
    parser.add_argument("--batched-mm-gb", type=float, default=4.0,
                        help="experts: skip batched_mm where its gathered weights and their gradients pass this")
    parser.add_argument("--model-sizes", type=lambda s: tuple(map(int, s.split("x"))), nargs="+",
                        default=[(64, 2), (256, 4)], help="step: HIDDENxLAYERS of the models")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "moe.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    results: dict[str, Any] = {"threads": args.threads, "torch": torch.__version__,
                               "transformers": transformers.__version__}
    if args.what in ("experts", "both"):
        results["policy_experts_implementation"] = policy_implementation()
        print(f"rltrainer's policy runs its experts with: {results['policy_experts_implementation']}")
        results["experts"] = bench_experts(args)
    if args.what in ("step", "both"):
        results["step"] = bench_step(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

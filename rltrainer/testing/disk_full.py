"""A tiny GRPO run that meets a full disk, for the tests of what that does (single and FSDP2 ranks).

``run_disk_full(tmp, leave_bytes, ...)`` runs ``python -m rltrainer.testing.disk_full`` on a private
tmpfs (:mod:`rltrainer.testing.tmpfs`): a checkpoint every ``every`` steps, metrics to ``logger`` (a
Trainer ``logger`` name: ``"csv"``, ``"tensorboard"``); at the end of step 1 the disk is filled but
``leave_bytes``. It returns the run's report (the error that ended ``fit``: its
type, errno, message, step, and the seconds from filling the disk to the error) and a copy of what
the run left on the disk.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from rltrainer import GRPO, Callback, LogGenerations, ModelCheckpoint, Trainer, prompt_dataloader
from rltrainer.data import load_rows, prepare_gsm8k
from rltrainer.testing import data_path, load_tokenizer, tiny_qwen2_config
from rltrainer.testing.tmpfs import fill, run_in_tmpfs


def _parity(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(len(c) % 2) for c in completions]


def main(root: str, leave: int, strategy: str, devices: int, every: int, report_path: str, logger: str = "csv") -> None:
    torch.set_num_threads(1)
    filled: dict[str, float] = {}

    class FillDisk(Callback):
        def on_step_end(self, trainer: Any, module: Any, metrics: Any) -> None:
            if trainer.global_step == 1:
                fill(Path(root), leave)
                filled["at"] = time.perf_counter()

    if strategy != "single":
        import ray

        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    tok = load_tokenizer("gsm8k-bpe4k")
    rows = prepare_gsm8k(load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(8)), tok,
                         max_prompt_length=160)
    module = GRPO(tiny_qwen2_config(len(tok), hidden_size=32, num_layers=2), tok, reward_funcs=_parity,
                  num_generations=2, max_new_tokens=4, lr=1e-3)
    trainer = Trainer(strategy=strategy, devices=devices, max_steps=3 if every == 1 else 16,
                      enable_progress_bar=False, default_root_dir=root, logger=logger,
                      callbacks=[LogGenerations(every_n_steps=None), ModelCheckpoint(every_n_steps=every), FillDisk()])
    report: dict[str, Any] = {}
    try:
        trainer.fit(module, prompt_dataloader(rows, batch_size=2, shuffle=False))
    except BaseException as exc:
        report = {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
                  "errno": getattr(exc, "errno", None), "message": str(exc), "step": trainer.global_step,
                  "seconds": time.perf_counter() - filled["at"], "traceback": traceback.format_exc(),
                  "left_running": _processes_after(2.0)}
    os.remove(os.path.join(root, "filler"))
    Path(report_path).write_text(json.dumps(report))


def _processes_after(seconds: float) -> list[str]:
    """The names (``ray::FSDP2Worker``, ``raylet``...) of this process's descendants ``seconds`` from now."""
    try:
        import psutil
    except ImportError:  # only Ray brings it
        return ["(psutil is not installed)"]
    time.sleep(seconds)
    names = []
    for child in psutil.Process().children(recursive=True):
        try:
            names.append((child.cmdline() or [child.name()])[0].rsplit("/", 1)[-1])
        except psutil.Error:  # it ended meanwhile
            pass
    return sorted(names)


def run_disk_full(tmp: Path, leave_bytes: int, every: int = 1, strategy: str = "single", devices: int = 1,
                  size_bytes: int = 24 << 20, timeout: float = 300,
                  logger: str = "csv") -> tuple[dict[str, Any], Path, Any]:
    """Run :func:`main` on a private tmpfs of ``size_bytes`` under ``tmp``: its report (``{}`` if
    ``fit`` ended without an error), the directory holding a copy of what it left on the disk, and
    the finished process."""
    mnt, kept, report = tmp / "mnt", tmp / "kept", tmp / "report.json"
    mnt.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1",
           "RAY_AUTH_MODE": "disabled"}
    argv = [sys.executable, "-m", "rltrainer.testing.disk_full", str(mnt), str(leave_bytes), strategy, str(devices),
            str(every), str(report), logger]
    done = run_in_tmpfs(argv, mnt, size_bytes, keep=kept, env=env, timeout=timeout)
    return (json.loads(report.read_text()) if report.is_file() else {}), kept, done


if __name__ == "__main__":
    root_, leave_, strategy_, devices_, every_, report_, logger_ = sys.argv[1:8]
    main(root_, int(leave_), strategy_, int(devices_), int(every_), report_, logger_)

"""Nothing lost on a fault: a run killed at any point keeps every step it logged, a resumed run writes
on in the same ``metrics.csv`` (each step once), and a full disk is one clear error naming the file,
with the previous checkpoint and every metric already written intact."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rltrainer import LogGenerations, Trainer
from rltrainer.checkpoints import DiskFullError, read_trainer_state
from rltrainer.csv_logger import CSVLogger
from rltrainer.files import append_rows, read_rows
from rltrainer.testing import disk_full
from rltrainer.testing.tmpfs import tmpfs_unavailable

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}

#: A tiny GRPO run: ``python train.py ROOT MAX_STEPS KILL_AT [ckpt_path]``; it SIGKILLs itself at the end
#: of step KILL_AT (after the step is logged and checkpointed), or writes ``ROOT/done`` when it finishes.
TRAIN = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    from rltrainer import GRPO, Callback, LogGenerations, ModelCheckpoint, Trainer, prompt_dataloader
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.testing import data_path, load_tokenizer, tiny_qwen2_config

    root, max_steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    class Kill(Callback):
        def on_step_end(self, trainer, module, metrics):
            if trainer.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def parity(completions, **kwargs):
        return [float(len(c) % 2) for c in completions]

    tok = load_tokenizer("gsm8k-bpe4k")
    rows = prepare_gsm8k(load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(12)), tok,
                         max_prompt_length=160)
    module = GRPO(tiny_qwen2_config(len(tok), hidden_size=32, num_layers=2), tok, reward_funcs=parity,
                  num_generations=2, max_new_tokens=4, lr=1e-3)
    trainer = Trainer(max_steps=max_steps, enable_progress_bar=False, default_root_dir=root,
                      callbacks=[LogGenerations(every_n_steps=None), ModelCheckpoint(every_n_steps=2), Kill()])
    trainer.fit(module, prompt_dataloader(rows, batch_size=2, shuffle=False),
                ckpt_path=sys.argv[4] if len(sys.argv) > 4 else None)
    open(os.path.join(root, "done"), "w").close()
""")


def steps_logged(path: Path) -> list[int]:
    return [int(row["step"]) for row in read_rows(path)[1] if row.get("critic/score/mean")]


# -- durable metrics ------------------------------------------------------------------------------------
def test_log_flush_s_is_checked():
    with pytest.raises(ValueError, match=r"log_flush_s must be a number >= 0 \(seconds; .* got -1"):
        Trainer(log_flush_s=-1, logger=False)
    with pytest.raises(ValueError, match="got '5'"):
        Trainer(log_flush_s="5", logger=False)


def test_a_killed_run_keeps_every_logged_step_and_the_resumed_run_writes_on_in_one_csv(tmp_path):
    """SIGKILL at the end of step 3 (checkpoint at step 2): metrics.csv holds steps 1-3 (Lightning's CSV
    logger alone: none, it writes every 100 steps); the resumed run replaces step 3 and goes on to 5,
    in the same version_0/metrics.csv, each step once."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    killed = subprocess.run([sys.executable, str(script), str(tmp_path), "5", "3"], env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    csv_path = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    assert steps_logged(csv_path) == [1, 2, 3]
    assert read_trainer_state(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 2

    resumed = subprocess.run([sys.executable, str(script), str(tmp_path), "5", "0", "last"], env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and (tmp_path / "done").exists(), resumed.stderr[-2000:]
    assert [p.name for p in csv_path.parent.parent.iterdir()] == ["version_0"]
    assert steps_logged(csv_path) == [1, 2, 3, 4, 5]
    assert csv_path.read_text().count("critic/score/mean") == 1  # one header


def test_csv_rows_are_appended_and_a_new_column_rewrites_the_file_whole(tmp_path):
    logger = CSVLogger(tmp_path, name="logs")
    logger.log_metrics({"a": 1.0}, step=1)
    logger.save()
    path = Path(logger.log_dir) / "metrics.csv"
    inode = path.stat().st_ino
    logger.log_metrics({"a": 2.0}, step=2)
    logger.save()
    assert path.stat().st_ino == inode  # appended in place
    logger.log_metrics({"a": 3.0, "b": 1.0}, step=3)
    logger.save()
    assert path.stat().st_ino != inode  # a new column: a new file renamed over the old one
    keys, rows = read_rows(path)
    assert keys == ["a", "b", "step"] and [(r["a"], r["b"]) for r in rows] == [("1.0", ""), ("2.0", ""), ("3.0", "1.0")]
    with path.open("a") as f:  # a killed write's torn last row is not read back
        f.write("4.0,")
    assert len(read_rows(path)[1]) == 3
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []


def test_appending_1000_rows_one_save_each_costs_little(tmp_path):
    """The cost of ``log_flush_s=0``: one save per step on a log that grows to 1000 rows of 60 columns."""
    logger = CSVLogger(tmp_path, name="logs")
    metrics = {f"group/metric_{i}": float(i) for i in range(60)}
    times = []
    for step in range(1, 1001):
        logger.log_metrics(metrics, step=step)
        start = time.perf_counter()
        logger.save()
        times.append(time.perf_counter() - start)
    assert len(read_rows(Path(logger.log_dir) / "metrics.csv")[1]) == 1000
    late = sorted(times[-100:])[50]  # median of the last 100 saves
    print(f"save per step: median {late * 1e6:.0f} us at ~1000 rows")
    assert late < 0.02  # appends: a rewrite of 1000 rows would not scale like this


class HalfThenFull:
    """A file whose first write stores half the bytes and the next one finds the disk full."""

    def __init__(self, f):
        self.f, self.writes = f, 0

    def write(self, data):
        self.writes += 1
        if self.writes > 1:
            raise OSError(28, "No space left on device")
        return self.f.write(bytes(data)[: len(data) // 2])

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_full_disk_while_appending_leaves_metrics_csv_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "metrics.csv"
    append_rows(path, ["a", "step"], [{"a": 1, "step": 1}])
    before = path.read_bytes()
    monkeypatch.setattr("rltrainer.files.open", lambda *a, **k: HalfThenFull(open(*a, **k)), raising=False)
    with pytest.raises(DiskFullError, match=r"disk is full .* writing .*metrics.csv \(1 metrics row"):
        append_rows(path, ["a", "step"], [{"a": 2, "step": 2}])
    assert path.read_bytes() == before  # the half row was cut off



class Saver:
    def __init__(self, error=None):
        self.error, self.saved = error, 0

    def log_metrics(self, metrics, step):
        pass

    def save(self):
        self.saved += 1
        if self.error:
            raise self.error


def test_a_logger_failing_to_save_never_hides_the_error_that_ends_fit(caplog):
    """Every logger is saved even if one fails; while an error ends fit, a failing save is logged (the
    CSV logger's final save used to raise a second ENOSPC over the checkpoint's)."""
    from rltrainer.loggers import save_loggers

    full, fine = Saver(OSError(28, "No space left on device")), Saver()
    with pytest.raises(OSError, match="No space"):
        save_loggers([full, fine])
    assert fine.saved == 1
    save_loggers([full, fine], failing=RuntimeError("the first error"))  # logged, not raised
    assert fine.saved == 2 and "Saver could not save its log (OSError" in caplog.text
    assert "while RuntimeError ends the run" in caplog.text


def test_fit_raises_its_own_error_not_the_final_logger_save_s(tmp_path, tiny_config, bpe_tokenizer, gsm8k_prompts):
    from rltrainer import GRPO, Callback, prompt_dataloader

    class Boom(Callback):
        def on_step_end(self, trainer, module, metrics):
            raise RuntimeError("the first error")

    full = Saver(OSError(28, "No space left on device"))
    trainer = Trainer(max_steps=2, logger=[full], log_flush_s=float("inf"), enable_progress_bar=False,
                      default_root_dir=tmp_path, callbacks=[Boom()])
    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                  num_generations=2, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="the first error"):
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2, shuffle=False))
    assert full.saved == 1  # the final save ran, and failed quietly

# -- a full disk ------------------------------------------------------------------------------------------
needs_tmpfs = pytest.mark.skipif(tmpfs_unavailable() is not None, reason=str(tmpfs_unavailable()))

def run_disk_full(tmp_path: Path, leave_bytes: int, every: int = 1) -> tuple[dict, Path]:
    report, kept, done = disk_full.run_disk_full(tmp_path, leave_bytes, every=every)
    assert done.returncode == 0 and report, done.stderr[-3000:]
    return report, kept


def assert_disk_full(report: dict, file: str) -> None:
    assert report["type"] == "DiskFullError" and report["errno"] == 28 and "OSError" in report["mro"], report
    assert "The disk is full (No space left on device) writing " in report["message"]
    assert f"{file} (" in report["message"] and "bytes were free" in report["message"], report["message"]
    assert "unexpected pos" not in report["message"] and report["seconds"] < 30
    assert report["left_running"] == []  # no process of the run outlives the error


@needs_tmpfs
def test_a_full_disk_in_a_checkpoint_save_is_one_clear_error_and_loses_nothing_written(tmp_path):
    """64 KiB left after step 1: step 2's checkpoint (its models and Adam moments: ~2.5 MB) does not fit.
    One DiskFullError naming the file and the bytes (not torch's "unexpected pos", and not the CSV logger's
    final save failing in its turn); last.ckpt is step 1, whole; metrics.csv has steps 1 and 2."""
    report, kept = run_disk_full(tmp_path, 64 << 10)
    assert_disk_full(report, "training/state.pt")
    assert "needed about 2," in report["message"] and report["step"] == 2
    assert os.readlink(kept / "checkpoints" / "last.ckpt") == "step=1.ckpt"
    assert read_trainer_state(kept / "checkpoints" / "step=1.ckpt")["global_step"] == 1
    assert not list((kept / "checkpoints").glob(".*tmp-*"))  # the failed save removed its partial directory
    assert steps_logged(kept / "lightning_logs" / "version_0" / "metrics.csv") == [1, 2]


@needs_tmpfs
def test_a_full_disk_while_logging_is_one_clear_error_and_keeps_every_row_written(tmp_path):
    """Nothing left after step 1 (no checkpoints): the first row that needs a new page of metrics.csv
    (4 KiB; a row is ~400 bytes) fails. One DiskFullError naming metrics.csv; the rows before it are all there, none torn."""
    report, kept = run_disk_full(tmp_path, 0, every=100)
    assert_disk_full(report, "metrics.csv")
    assert report["step"] >= 2
    assert steps_logged(kept / "lightning_logs" / "version_0" / "metrics.csv") == list(range(1, report["step"]))


@needs_tmpfs
def test_a_full_disk_under_tensorboard_is_the_csv_loggers_disk_full_error(tmp_path):
    """It was Lightning's ``ValueError: you tried to log 1.0 which is currently not supported``, naming no file."""
    report, kept, done = disk_full.run_disk_full(tmp_path, 0, every=100, logger="tensorboard")
    assert done.returncode == 0 and report, done.stderr[-3000:]
    assert_disk_full(report, "")
    assert re.search(r"writing \S+/lightning_logs/version_0/events\.out\.tfevents\.\S+ \(TensorBoard's events: "
                     r"\d+ metrics of step \d+\)", report["message"]), report["message"]
    assert "not supported" not in report["message"]


# -- which checkpoint a resume loaded -------------------------------------------------------------------
def test_a_resume_logs_which_checkpoint_it_loaded_and_the_summary_says_it(tmp_path, tiny_config, bpe_tokenizer,
                                                                          gsm8k_prompts, caplog):
    from rltrainer import GRPO, ModelCheckpoint, prompt_dataloader
    from rltrainer.cli import summary

    def run(max_steps, ckpt_path=None):
        trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                          callbacks=[ModelCheckpoint(every_n_steps=1)])
        module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                      num_generations=2, max_new_tokens=4)
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2, shuffle=False), ckpt_path=ckpt_path)
        return trainer

    assert "resumed from" not in summary(run(2), 1.0, [])
    caplog.set_level("INFO", logger="rltrainer.trainer")
    trainer = run(3, ckpt_path="last")
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert f"Resuming from checkpoint {last} -> {(tmp_path / 'checkpoints' / 'step=2.ckpt').resolve()} (step 2)" \
        in caplog.text
    assert f"  resumed from: {last} (step 2)" in summary(trainer, 1.0, []).splitlines()


@pytest.mark.parametrize("log_flush_s", [0, float("inf")])
def test_each_logged_step_is_on_disk_before_the_next_step(log_flush_s, tmp_path, tiny_config, bpe_tokenizer,
                                                          gsm8k_prompts):
    """What a callback at the end of step 2 finds on disk: metrics.csv and TensorBoard's events hold steps
    1 and 2 (``log_flush_s=0``), or, in metrics.csv, nothing yet (``inf``: only at the end of fit)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rltrainer import GRPO, Callback, prompt_dataloader

    seen = {}

    class Look(Callback):
        def on_step_end(self, trainer, module, metrics):
            if trainer.global_step == 2:
                csv_path = Path(trainer.loggers[0].log_dir) / "metrics.csv"
                seen["csv"] = steps_logged(csv_path) if csv_path.is_file() else []
                events = EventAccumulator(trainer.loggers[1].log_dir)
                events.Reload()
                tags = events.Tags()["scalars"]
                seen["tb"] = [e.step for e in events.Scalars("critic/score/mean")] if "critic/score/mean" in tags else []

    trainer = Trainer(max_steps=2, logger=["csv", "tensorboard"], log_flush_s=log_flush_s, enable_progress_bar=False,
                      default_root_dir=tmp_path, callbacks=[LogGenerations(every_n_steps=None), Look()])
    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                  num_generations=2, max_new_tokens=4)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2, shuffle=False))
    assert seen["csv"] == ([1, 2] if log_flush_s == 0 else [])
    if log_flush_s == 0:  # (TensorBoard's writer also flushes when its queue of 10 events fills: not a test of inf)
        assert seen["tb"] == [1, 2]
    assert steps_logged(Path(trainer.loggers[0].log_dir) / "metrics.csv") == [1, 2]  # all there at the end


def test_a_full_disks_message_has_the_figures_that_explain_it(tmp_path):
    """FSDP2's said a rank "needed 1,234,728 bytes" while "1,294,336 were free": the other rank's shards,
    written into the same file system at once, were the rest of the story."""
    from rltrainer.files import disk_full_error

    shard = tmp_path / "shard"
    shard.write_bytes(b"x" * 1000)
    message = str(disk_full_error(shard, "this rank's shards", 5000, 3000, ("the 2 ranks' shards together", 10000)))
    stats = os.statvfs(tmp_path)
    assert (f"writing {shard} (this rank's shards): it needed about 5,000 bytes, and the 2 ranks' shards together "
            f"about 10,000 bytes written into the same file system at once; 1,000 bytes were written there before the "
            f"space ran out; 3,000 bytes were free when it started, of the {stats.f_blocks * stats.f_frsize:,} of the "
            f"file system mounted at ") in message
    reserved = (stats.f_bfree - stats.f_bavail) * stats.f_frsize
    assert (f"({reserved:,} more are reserved for root)" in message) == (reserved > 0)

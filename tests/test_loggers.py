"""Logs are whole: a ``validate()`` after ``fit`` reaches every logger and is saved at once, and a run
resumed from a checkpoint writes on in the log version the checkpointed run wrote."""

from __future__ import annotations

import csv
from pathlib import Path

from rltrainer import GRPO, LogGenerations, Trainer, prompt_dataloader
from rltrainer.loggers import continue_logs, log_versions


def parity_reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def make_module(config, tokenizer):
    return GRPO(config, tokenizer, reward_funcs=parity_reward, num_generations=2, max_new_tokens=4, lr=1e-3)


class Recorder:
    """A logger of its own: records every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def log_metrics(self, metrics, step):
        self.calls.append(("log_metrics", step, sorted(metrics)))

    def save(self):
        self.calls.append(("save",))


def csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_validate_after_fit_reaches_every_logger_and_is_saved(tmp_path, tiny_config, bpe_tokenizer, gsm8k_prompts):
    recorder = Recorder()
    trainer = Trainer(max_steps=2, logger=["csv", recorder], default_root_dir=tmp_path, enable_progress_bar=False,
                      callbacks=[LogGenerations(every_n_steps=None)])
    module = make_module(tiny_config, bpe_tokenizer)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2, shuffle=False))
    recorder.calls.clear()
    metrics = trainer.validate(module, prompt_dataloader(gsm8k_prompts.select(range(2)), batch_size=2, shuffle=False))
    assert recorder.calls[0] == ("log_metrics", 2, sorted(metrics)) and recorder.calls[-1] == ("save",)
    _, rows = csv_rows(Path(trainer.loggers[0].log_dir) / "metrics.csv")  # no save() by the caller
    (val,) = [r for r in rows if r.get("val/score")]
    assert val["step"] == "2" and float(val["val/score"]) == metrics["val/score"]


def test_a_resumed_run_continues_the_checkpointed_runs_csv_log(tmp_path, tiny_config, bpe_tokenizer, gsm8k_prompts):
    """Checkpoint at step 2; the first run goes on to step 3 and stops; the resumed run (a new Trainer,
    as after a restart) writes steps 3 and 4 into the same version_0/metrics.csv, replacing the
    interrupted run's step 3, under one header; the plot covers steps 1-4."""
    loader = prompt_dataloader(gsm8k_prompts, batch_size=2, shuffle=False)
    first = Trainer(max_steps=2, logger=["csv", "tensorboard"], default_root_dir=tmp_path, enable_progress_bar=False)
    module = make_module(tiny_config, bpe_tokenizer)
    first.fit(module, loader)
    first.save_checkpoint(tmp_path / "step2")
    first.max_steps = 3
    first.fit(module, loader)  # the interrupted run's step 3, past its checkpoint
    log_dir = Path(first.loggers[0].log_dir)
    versions = sorted(p.name for p in log_dir.parent.iterdir())  # the CSV and the TensorBoard log
    assert [r["step"] for r in csv_rows(log_dir / "metrics.csv")[1] if r.get("critic/score/mean")] == ["1", "2", "3"]

    resumed = Trainer(max_steps=4, logger=["csv", "tensorboard"], default_root_dir=tmp_path,
                      enable_progress_bar=False)
    resumed.fit(make_module(tiny_config, bpe_tokenizer), loader, ckpt_path=tmp_path / "step2")
    assert Path(resumed.loggers[0].log_dir) == log_dir and resumed.loggers[1].log_dir == first.loggers[1].log_dir
    assert sorted(p.name for p in log_dir.parent.iterdir()) == versions  # no new version
    header, rows = csv_rows(log_dir / "metrics.csv")
    assert (log_dir / "metrics.csv").read_text().count("critic/score/mean") == 1 and "step" in header
    assert [r["step"] for r in rows if r.get("critic/score/mean")] == ["1", "2", "3", "4"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(resumed.loggers[1].log_dir)
    events.Reload()  # TensorBoard drops the interrupted run's step 3 (purge_step)
    assert [e.step for e in events.Scalars("critic/score/mean")] == [1, 2, 3, 4]

    from rltrainer.plot import read_series

    assert read_series(log_dir / "metrics.csv")["critic/score/mean"][0] == [1.0, 2.0, 3.0, 4.0]


def test_a_logger_given_another_version_or_that_logged_already_keeps_it(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    named = CSVLogger(tmp_path, name="logs", version="mine")
    fresh = CSVLogger(tmp_path, name="logs")
    saved = log_versions([CSVLogger(tmp_path, name="logs", version=0), Recorder(), CSVLogger(tmp_path, name="logs",
                                                                                              version=0)])
    assert saved == [{"kind": "CSVLogger", "version": 0}, None, {"kind": "CSVLogger", "version": 0}]
    continue_logs([named, Recorder(), fresh], {"loggers": saved, "global_step": 0})
    assert named.version == "mine" and fresh.version == 0
    assert not (tmp_path / "logs" / "version_1").exists()

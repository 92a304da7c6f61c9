"""Sample generations reach each logger in its own form, and the CSV log plots into one PNG."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rltrainer import GRPO, LogGenerations, Trainer, prompt_dataloader
from rltrainer.generations import write_generations

ROW_KEYS = {"step", "split", "prompt", "response", "reward", "advantage", "finish_reason", "reward/odd_length",
            "reward/short"}


def odd_length(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def short(completions, **kwargs):
    return [float(len(c) < 10) for c in completions]


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, tiny_config, bpe_tokenizer, gsm8k_prompts):
    """3 steps with CSV and TensorBoard loggers: generations every 2 steps (3 rows), validation at steps 0, 2
    (val_check_interval) and 3 (the end)."""
    root = tmp_path_factory.mktemp("run")
    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=[odd_length, short], num_generations=2, max_new_tokens=6,
                  lr=1e-3)
    trainer = Trainer(max_steps=3, max_epochs=100, val_check_interval=2, limit_val_batches=1,
                      logger=["csv", "tensorboard"], default_root_dir=root, enable_progress_bar=False,
                      callbacks=[LogGenerations(every_n_steps=2, rows=3)])
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=4),
                val_dataloaders=prompt_dataloader(gsm8k_prompts, batch_size=2, shuffle=False))
    return trainer


@pytest.fixture(scope="module")
def tiny_config(bpe_tokenizer):
    from rltrainer.testing import tiny_qwen2_config

    return tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)


def test_csv_logger_writes_generations_jsonl_beside_metrics_csv(logged_run):
    log_dir = Path(logged_run.loggers[0].log_dir)
    assert (log_dir / "metrics.csv").is_file()
    rows = [json.loads(line) for line in (log_dir / "generations.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in train] == [2, 2, 2] and len(val) == 6  # 3 rows at step 2; 3 validations x 2 prompts
    assert {r["step"] for r in val} == {0, 2, 3}  # before the first step, the val_check_interval one, the final one
    assert all(set(r) == ROW_KEYS for r in rows)
    for r in rows:
        assert "<|im_start|>user" in r["prompt"] and isinstance(r["response"], str)
        assert r["reward"] == pytest.approx(r["reward/odd_length"] + r["reward/short"])
        assert r["finish_reason"] in ("stop", "length")
    assert all(isinstance(r["advantage"], float) for r in train) and all(r["advantage"] is None for r in val)


def test_tensorboard_logger_gets_a_text_table(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = logged_run.loggers[1]
    events = EventAccumulator(tb.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    tags = events.Tags()["tensors"]
    assert "generations/train/text_summary" in tags and "generations/val/text_summary" in tags
    (train,) = events.Tensors("generations/train/text_summary")
    table = train.tensor_proto.string_val[0].decode()
    assert train.step == 2 and table.startswith("| prompt | response | reward | advantage | finish_reason |")
    assert len(table.splitlines()) == 2 + 3


def test_wandb_and_mlflow_get_a_table_and_an_artifact():
    calls = []

    class WandbLogger:  # the calls the real loggers' APIs take (lightning's WandbLogger, MlflowClient)
        def log_table(self, key, columns, data, step):
            calls.append(("wandb", key, columns, data, step))

    class Client:
        def log_dict(self, run_id, dictionary, artifact_file):
            calls.append(("mlflow", run_id, dictionary, artifact_file))

    class MLFlowLogger:
        run_id, experiment = "run-1", Client()

    rows = [{"prompt": "1+1=", "response": "2", "reward": 1.0}]
    write_generations([WandbLogger(), MLFlowLogger()], rows, step=7, split="train")
    assert calls[0] == ("wandb", "generations/train", ["prompt", "response", "reward"], [["1+1=", "2", 1.0]], 7)
    assert calls[1] == ("mlflow", "run-1", {"step": 7, "split": "train", "rows": rows},
                        "generations/train_step000007.json")


def test_plot_draws_one_png_from_the_csv_log(logged_run, tmp_path):
    from rltrainer.plot import PANELS, main, read_series

    root = Path(logged_run.default_root_dir)
    out = main([str(root), "-o", str(tmp_path / "run.png")])  # finds the newest metrics.csv below root
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    series = read_series(Path(logged_run.loggers[0].log_dir) / "metrics.csv")
    assert series["critic/score/mean"][0] == [1.0, 2.0, 3.0] and series["val/score"][0] == [0.0, 2.0, 3.0]
    assert all(any(n in series for n in names) for names in PANELS.values())  # KL: actor/ppo_kl (kl_coef=0)
    with pytest.raises(FileNotFoundError, match="No metrics.csv in or below"):
        main([str(tmp_path)])


GETTING_STARTED = Path(__file__).resolve().parents[1] / ".ci" / "docs" / "pages" / "getting-started.md"


def test_the_panels_draw_what_the_run_logged_as_the_getting_started_page_says(tmp_path, tiny_config, bpe_tokenizer,
                                                                                gsm8k_prompts):
    """Issue 44, item 16: validation draws val/accuracy where it exists (not val/score); the KL panel draws
    the KL metrics the run logged, as the getting-started page names them for the addition recipe's run
    (sync, the hf engine, kl_coef=0, several optimizer steps a batch), and a run with one optimizer step a
    batch (the new-task page's) gets a curve too, not "not logged"."""
    from rltrainer.plot import panel_curves, read_series

    def logged(**kwargs):
        module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=odd_length, num_generations=2, max_new_tokens=3,
                      lr=1e-3, **kwargs)
        trainer = Trainer(max_steps=1, logger="csv", default_root_dir=tmp_path, enable_progress_bar=False)
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=4),
                    val_dataloaders=prompt_dataloader(gsm8k_prompts.select(range(2)), batch_size=2, shuffle=False))
        return read_series(Path(trainer.loggers[0].log_dir) / "metrics.csv")

    recipe = logged(mini_batch_size=4)  # 8 rows a step: 2 optimizer steps, as the recipe's 4
    assert {"val/score", "val/accuracy"} <= set(recipe) and panel_curves("validation", recipe) == ["val/accuracy"]
    sentence = re.search(r"the KL panel shows (.*?)\)", GETTING_STARTED.read_text().replace("\n", " "))[1]
    named = re.findall(r"`(\w+/\w+)`", sentence)
    assert panel_curves("KL", recipe) == ["rollout_corr/kl", "actor/ppo_kl"] and set(named) == set(
        panel_curves("KL", recipe)), sentence
    assert panel_curves("KL", logged()) == ["actor/ppo_kl"]  # one optimizer step a batch


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[16:24]  # the IHDR chunk: width, height
    return int.from_bytes(header[:4], "big"), int.from_bytes(header[4:], "big")


def test_plot_adds_moe_panels_only_for_a_run_that_logged_moe_metrics(tmp_path, monkeypatch):
    """A MoE run's plot gets MOE_PANELS to the right of the usual six, every one of their metrics
    drawn; a dense run's plot is the usual six, as wide as before."""
    import rltrainer.plot as plot

    drawn, draw = {}, plot._draw
    monkeypatch.setattr(plot, "_draw", lambda ax, title, names, curves, series: (
        drawn.__setitem__(title, curves), draw(ax, title, names, curves, series)))
    dense = ["step", "critic/score/mean", "timing_s/step"]
    moe = sorted({name for names in plot.MOE_PANELS.values() for name in names})
    for name, columns in (("dense", dense), ("moe", dense + moe)):
        (tmp_path / name).mkdir()
        rows = [",".join(columns)] + [",".join([str(step)] + [str(0.1 * step)] * (len(columns) - 1))
                                      for step in range(1, 6)]
        (tmp_path / name / "metrics.csv").write_text("\n".join(rows) + "\n")

    assert _png_size(plot.plot_run(tmp_path / "dense")) == (960, 496)  # 12 x 6.2 inches at 80 dpi, 3 panels a row
    assert list(drawn) == list(plot.PANELS) and drawn["reward"] == ["critic/score/mean"]
    drawn.clear()
    assert _png_size(plot.plot_run(tmp_path / "moe")) == (1560, 496)  # 5 a row: the six, the four MoE ones beside
    assert list(drawn) == list(plot.PANELS) + list(plot.MOE_PANELS)
    assert {name: drawn[name] for name in plot.MOE_PANELS} == {name: list(v) for name, v in plot.MOE_PANELS.items()}
    assert drawn["expert share (1/E when balanced)"] == ["moe/expert_share/max", "moe/expert_share/min"]


def test_multi_turn_generations_show_what_the_model_saw(tmp_path, tiny_config, bpe_tokenizer):
    """A multi-turn row's prompt is the environment's first observation as rendered (not the dataset's
    placeholder prompt), and its response the whole episode with the environment's replies."""
    from rltrainer.envs import Environment, MultiTurn, StepResult

    class Echo(Environment):
        def reset(self, row):
            return [{"role": "user", "content": f"Say something ({row['secret']})."}]

        def step(self, text):
            return StepResult("again", reward=0.5)

    placeholder = bpe_tokenizer("unused", add_special_tokens=False).input_ids
    rows = [{"prompt_ids": placeholder, "secret": i} for i in range(4)]
    module = GRPO(tiny_config, bpe_tokenizer, None, num_generations=2, max_new_tokens=3,
                  environment=MultiTurn(Echo, max_turns=2, max_workers=0))
    trainer = Trainer(max_steps=1, logger="csv", default_root_dir=tmp_path, enable_progress_bar=False,
                      callbacks=[LogGenerations(every_n_steps=1, rows=2)])
    trainer.fit(module, prompt_dataloader(rows, batch_size=2, shuffle=False),
                val_dataloaders=prompt_dataloader(rows[:2], batch_size=2, shuffle=False))
    logged = [json.loads(line) for line in (Path(trainer.loggers[0].log_dir) / "generations.jsonl").open()]
    assert {r["split"] for r in logged} == {"train", "val"} and len(logged) == 4
    for r in logged:
        assert "Say something (" in r["prompt"] and "unused" not in r["prompt"]
        assert r["prompt"].rstrip().endswith("<|im_start|>assistant")
        assert "<|im_start|>user\nagain<|im_end|>" in r["response"], r["response"]
        assert r["reward"] == 0.5 * 2  # two turns, 0.5 each

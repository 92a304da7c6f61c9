"""A user's own task through the CLI: a task defined only in a YAML file and a module outside the
package (a GRPO subclass and a reward function by dotted path, data from a JSONL with its own
columns), interrupted with Ctrl-C and resumed with ``--ckpt_path last``; parse errors as one
message; and, from Python, Ctrl-C during ``fit`` and a second run beside the first."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rltrainer import GRPO, Callback, LogGenerations, ModelCheckpoint, Trainer
from rltrainer.checkpoints import find_last_run, read_trainer_state
from rltrainer.cli import main, resume_command
from rltrainer.data import prompt_dataloader

ROOT = Path(__file__).resolve().parents[1]

USER_MODULE = '''
import os
import signal

from rltrainer import GRPO, Callback


def partial_credit(completions, target, **kwargs):
    """A share of the target's characters in place; the JSONL's ``target`` column arrives as a keyword."""
    return [sum(a == b for a, b in zip(c.strip(), t)) / len(t) for c, t in zip(completions, target)]


class ReverseGRPO(GRPO):
    """GRPO that notes each step it trains (the test reads where a resumed run starts)."""

    def __init__(self, *args, step_log: str = "steps.txt", **kwargs):
        super().__init__(*args, **kwargs)
        self.step_log = step_log

    def on_step_end(self, metrics):
        with open(self.step_log, "a") as f:
            f.write(f"{self.trainer.global_step}\\n")


class DoubleCtrlC(Callback):
    """Two Ctrl-C at the end of step 1: the second one stops at once."""

    def on_step_end(self, trainer, module, metrics):
        if trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
'''

TASK = """
trainer:
  max_steps: 1000
  enable_progress_bar: false
  default_root_dir: {root}
  callbacks:
    - class_path: rltrainer.LogGenerations
      init_args: {{every_n_steps: null}}
    - class_path: rltrainer.ModelCheckpoint
      init_args: {{every_n_steps: 1}}
module:
  class_path: my_task.ReverseGRPO
  init_args:
    model:
      class_path: transformers.Qwen2Config
      init_args: {{vocab_size: 4096, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
                   num_attention_heads: 2, num_key_value_heads: 1, tie_word_embeddings: true}}
    tokenizer: gsm8k-bpe4k
    reward_funcs: [my_task.partial_credit]
    num_generations: 2
    max_new_tokens: 4
    step_log: {root}/steps.txt
data:
  train_file: {root}/reverse.jsonl
  format: prompts
  prompt_column: number
  use_chat_template: false
  batch_size: 2
"""


@pytest.fixture
def task(tmp_path) -> Path:
    """``task/task.yaml`` beside ``task/my_task.py``, and ``reverse.jsonl`` (columns ``number``,
    ``target``); returns the config."""
    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "my_task.py").write_text(USER_MODULE)
    with open(tmp_path / "reverse.jsonl", "w") as f:
        for n in range(100, 140):
            f.write(json.dumps({"number": f"Reverse {n}:", "target": str(n)[::-1]}) + "\n")
    (folder / "task.yaml").write_text(TASK.format(root=tmp_path))
    return folder / "task.yaml"


@pytest.fixture
def forget_user_modules():
    """The user modules an in-process test imported from its tmp_path are forgotten after it."""
    yield
    for name in ("my_task", "my_data"):
        sys.modules.pop(name, None)


def rltrainer(*args: str, cwd: Path) -> subprocess.Popen:
    """``python -m rltrainer`` in ``cwd``; the user module is found beside the config, not in ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "rltrainer", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def steps_of(tmp_path: Path) -> list[int]:
    return [int(line) for line in (tmp_path / "steps.txt").read_text().split()]


def test_a_yaml_task_is_interrupted_with_ctrl_c_and_resumed_from_the_cli(task, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    checkpoints = tmp_path / "checkpoints"
    run = rltrainer("fit", "--config", str(task), "--threads", "1", cwd=elsewhere)
    deadline = time.monotonic() + 300
    while not (checkpoints / "last.ckpt").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.poll() is None, run.communicate()[1][-3000:]
    run.send_signal(signal.SIGINT)  # after step 1 or later: the step in flight finishes, then a checkpoint
    out, err = run.communicate(timeout=300)
    assert run.returncode == 130, err[-3000:]
    interrupted = steps_of(tmp_path)[-1]
    assert interrupted >= 1 and f"interrupted after {interrupted}/1000 steps" in out
    assert f"Interrupted after step {interrupted}: saved" in err and "Traceback" not in err
    assert f"resume with:  rltrainer fit --config {task} --threads 1 --ckpt_path last" in out
    saved = checkpoints / f"step={interrupted}.ckpt"
    assert (checkpoints / "last.ckpt").resolve() == saved.resolve()
    assert read_trainer_state(saved)["global_step"] == interrupted

    resumed = rltrainer("fit", "--config", str(task), "--threads", "1", "--trainer.max_steps",
                        str(interrupted + 2), "--ckpt_path", "last", cwd=elsewhere)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert steps_of(tmp_path)[-2:] == [interrupted + 1, interrupted + 2]  # went on, not from step 1
    assert f"(step {interrupted})" in err and f"done: {interrupted + 2}/{interrupted + 2} steps" in out
    assert "critic/score/mean" in out and f"checkpoints:  {checkpoints}" in out and "python -m rltrainer.plot" in out
    assert not saved.exists()  # the interrupted run's checkpoint: pruned, keep=1 holds across the resume
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", f"step={interrupted + 2}.ckpt"]
    assert read_trainer_state(checkpoints / "last.ckpt")["global_step"] == interrupted + 2


def test_parse_errors_are_one_message_with_a_hint(task, capsys, monkeypatch, forget_user_modules):
    monkeypatch.setattr(sys, "path", [*sys.path])  # main() adds the config's folder
    assert main(["fit", "--config", str(task), "--trainer.max_stepz", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rltrainer fit: error: unrecognized arguments: --trainer.max_stepz 3")
    assert "Did you mean --trainer.max_steps?" in err and "--help" in err and "Traceback" not in err
    assert main(["fit", "--config", str(task), "--module.class_path", "my_task.Missing"]) == 2
    err = capsys.readouterr().err
    assert "my_task.Missing" in err and "has no attribute 'Missing'" in err and "Union" not in err
    assert main(["fit", "--config", str(task), "--trainer.max_steps", "many"]) == 2
    assert "trainer.max_steps" in capsys.readouterr().err
    assert main(["fit", "--config", str(task), "--data.format", "gsm9k"]) == 2  # the constructor refuses it
    err = capsys.readouterr().err
    assert "format='gsm9k') is not a known format; choose from prompts, gsm8k, math500" in err


USER_DATA = '''
from rltrainer.data import prompt_dataloader


class ReverseData:
    """A data module of the user's: no base class, set up with the module's tokenizer."""

    def __init__(self, n_train: int = 6, batch_size: int = 2) -> None:
        self.n_train, self.batch_size, self.tokenizer = n_train, batch_size, None

    def setup(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def train_dataloader(self):
        prompts = [f"Reverse {100 + i}:" for i in range(self.n_train)]
        rows = [{"prompt_ids": self.tokenizer(p, add_special_tokens=False)["input_ids"], "target": p[-4:-1][::-1]}
                for p in prompts]
        return prompt_dataloader(rows, self.batch_size, shuffle=False)
'''


def test_data_is_a_users_own_class_by_class_path(task, monkeypatch, forget_user_modules):
    from rltrainer.cli import fit_parser, import_paths, instantiate_fit

    (task.parent / "my_data.py").write_text(USER_DATA)
    monkeypatch.setattr(sys, "path", [*sys.path, *import_paths(["--config", str(task)])])
    parser = fit_parser()
    config = parser.parse_args(["--config", str(task), "--data", "my_data.ReverseData", "--data.n_train", "4"])
    built = instantiate_fit(parser, config)
    assert type(built["data"]).__name__ == "ReverseData" and built["data"].n_train == 4
    assert built["data"].tokenizer is built["module"].tokenizer  # setup(tokenizer) was called
    (batch,) = [b for b in built["data"].train_dataloader()][:1]
    assert list(batch["target"]) == ["001", "101"]
    assert type(built["module"]).__name__ == "ReverseGRPO"


def test_a_second_ctrl_c_stops_the_cli_at_once(task, tmp_path, capsys, monkeypatch, forget_user_modules):
    monkeypatch.setattr(sys, "path", [*sys.path])
    (task.parent / "twice.yaml").write_text("trainer:\n  callbacks:\n    - class_path: my_task.DoubleCtrlC\n")
    argv = ["fit", "--config", str(task), "--config", str(task.parent / "twice.yaml")]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "rltrainer fit: stopped at once at step 1, without saving it" in err and "Traceback" not in err
    assert f"rltrainer fit --config {task} --config {task.parent / 'twice.yaml'} --ckpt_path last" in err
    assert steps_of(tmp_path) == [1]


def test_the_resume_command_replaces_a_ckpt_path():
    assert resume_command(["fit", "--config", "a b.yaml", "--ckpt_path", "x", "--ckpt_path=y"]) == (
        "rltrainer fit --config 'a b.yaml' --ckpt_path last")


# -- from Python ---------------------------------------------------------------------------------------
class SigintAt(Callback):
    """Sends this process SIGINT at the end of the given steps (as a Ctrl-C would)."""

    def __init__(self, *steps: int) -> None:
        self.steps = steps

    def on_step_end(self, trainer, module, metrics):
        if trainer.global_step in self.steps:
            os.kill(os.getpid(), signal.SIGINT)


def reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def fit(tiny_config, tokenizer, prompts, root, callbacks, max_steps=50, ckpt_path=None):
    module = GRPO(tiny_config, tokenizer, reward_funcs=reward, num_generations=2, max_new_tokens=4, lr=1e-3)
    trainer = Trainer(max_steps=max_steps, logger="csv", enable_progress_bar=False, default_root_dir=root,
                      callbacks=[LogGenerations(every_n_steps=None), *callbacks])
    with trainer:
        trainer.fit(module, prompt_dataloader(prompts, batch_size=2, shuffle=False), ckpt_path=ckpt_path)
    return trainer


def test_ctrl_c_in_python_stops_after_the_step_with_a_checkpoint(tmp_path, tiny_config, bpe_tokenizer,
                                                                 gsm8k_prompts, caplog):
    before = signal.getsignal(signal.SIGINT)
    trainer = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, [SigintAt(2)])  # no ModelCheckpoint
    assert trainer.interrupted and trainer.global_step == 2
    assert signal.getsignal(signal.SIGINT) is before  # the previous handler is back
    last = find_last_run(tmp_path / "checkpoints")  # where ckpt_path="last" looks
    assert last is not None and read_trainer_state(last)["global_step"] == 2
    assert "ckpt_path='last'" in caplog.text
    assert list(tmp_path.glob("lightning_logs/version_*/metrics.csv"))  # the logger was flushed

    again = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, [], max_steps=3, ckpt_path="last")
    assert not again.interrupted and again.global_step == 3 and again.ckpt_path == last


def test_a_second_ctrl_c_stops_at_once(tmp_path, tiny_config, bpe_tokenizer, gsm8k_prompts):
    class TwoInOneStep(Callback):
        def on_step_end(self, trainer, module, metrics):
            if trainer.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, [TwoInOneStep()])
    assert signal.getsignal(signal.SIGINT) is before
    assert not (tmp_path / "checkpoints").exists()  # stopped without one


def test_a_fresh_run_writes_beside_an_earlier_runs_checkpoints(tmp_path, tiny_config, bpe_tokenizer,
                                                               gsm8k_prompts, caplog):
    """Running the same script again neither resumes silently nor replaces the earlier run's
    checkpoints (same step names): it writes to checkpoints-2, says so, and "last" is its newest."""
    first = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, [ModelCheckpoint(every_n_steps=1, keep=2)],
                max_steps=2)
    checkpoints = tmp_path / "checkpoints"
    kept = torch.load(checkpoints / "step=2.ckpt" / "trainer.pt", weights_only=False)["rng"]["torch"]
    time.sleep(0.05)  # "last" compares the checkpoints' times
    fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, [ModelCheckpoint(every_n_steps=1)], max_steps=3)
    assert "holds the checkpoints of an earlier run" in caplog.text and "checkpoints-2" in caplog.text
    assert first.global_step == 2 and os.readlink(checkpoints / "last.ckpt") == "step=2.ckpt"
    assert torch.equal(torch.load(checkpoints / "step=2.ckpt" / "trainer.pt", weights_only=False)["rng"]["torch"],
                       kept)  # untouched
    assert os.readlink(tmp_path / "checkpoints-2" / "last.ckpt") == "step=3.ckpt"
    assert find_last_run(checkpoints) == tmp_path / "checkpoints-2" / "last.ckpt"

    time.sleep(0.05)
    older = checkpoints / "step=1.ckpt"  # keep=2: the first run kept steps 1 and 2; resuming step 1 branches off
    fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, [ModelCheckpoint(every_n_steps=1)], max_steps=2,
        ckpt_path=older)
    assert os.readlink(tmp_path / "checkpoints-3" / "last.ckpt") == "step=2.ckpt"  # not over the first run's step 2
    assert torch.equal(torch.load(checkpoints / "step=2.ckpt" / "trainer.pt", weights_only=False)["rng"]["torch"],
                       kept)


def test_a_config_file_that_is_not_a_mapping_is_one_message(tmp_path, capsys):
    """An empty file gave `rltrainer fit: error: Unexpected config:` and nothing more."""
    empty = "is empty (or holds only comments)"
    for text, what in (("", empty), ("# nothing yet\n", empty), ("- module\n- data\n", "holds a list")):
        (tmp_path / "run.yaml").write_text(text)
        assert main(["fit", "--config", str(tmp_path / "run.yaml")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"rltrainer fit: error: the config file {tmp_path / 'run.yaml'} {what}: a config is a "
                              "YAML mapping of sections, at least `module:`"), err
        assert "Unexpected config" not in err and "recipes/configs/grpo_gsm8k_cpu.yaml" in err


def test_mistakes_in_the_data_settings_are_one_message_and_exit_2(task, tmp_path, capsys, monkeypatch,
                                                                  forget_user_modules):
    """A missing prompt_column or a misspelt train_file was a 24-line traceback and exit 1."""
    monkeypatch.setattr(sys, "path", [*sys.path])
    assert main(["fit", "--config", str(task), "--data.prompt_column", "numbr"]) == 2
    err = capsys.readouterr().err
    err = err[err.index("rltrainer fit: error:"):]  # after the datasets library's progress
    assert err.startswith(f"rltrainer fit: error: ValueError: PromptDataModule(train_file='{tmp_path}/reverse.jsonl', "
                          "format='prompts'): prepare_prompts(prompt_column='numbr'): the dataset has no such column; "
                          "its columns are ['number', 'target']"), err
    assert "Traceback" not in err and len(err.splitlines()) <= 3
    assert main(["fit", "--config", str(task), "--data.train_file", str(tmp_path / "revers.jsonl")]) == 2
    err = capsys.readouterr().err
    err = err[err.index("rltrainer fit: error:"):]
    assert err.startswith(f"rltrainer fit: error: ValueError: PromptDataModule(train_file='{tmp_path}/revers.jsonl', "
                          f"format='prompts'): Dataset file '{tmp_path}/revers.jsonl' does not exist"), err
    assert "Traceback" not in err


def test_print_config_writes_a_config_that_runs_as_it_is(task, tmp_path, capsys, monkeypatch, forget_user_modules):
    """``reward_funcs: [my_task.partial_credit]`` of rltrainer.GRPO was printed as ``Unable to serialize
    instance``: the printed config is parsed and built again here, and builds the same run."""
    import warnings

    from rltrainer.cli import build_parser, fit_parser, import_paths, instantiate_fit

    grpo = task.parent / "grpo.yaml"  # the task with rltrainer.GRPO itself (whose signature types reward_funcs)
    grpo.write_text("\n".join(line for line in task.read_text().replace("my_task.ReverseGRPO", "rltrainer.GRPO")
                               .splitlines() if "step_log" not in line))
    monkeypatch.setattr(sys, "path", [*sys.path, *import_paths(["--config", str(grpo)])])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit):
        warnings.simplefilter("always")
        build_parser().parse_args(["fit", "--config", str(grpo), "--print_config"])
    printed = capsys.readouterr().out
    assert not [w for w in caught if "serialize" in str(w.message)]
    assert "Unable to serialize" not in printed and "reward_funcs:\n    - my_task.partial_credit" in printed
    (tmp_path / "printed.yaml").write_text(printed)
    parser = fit_parser()
    built = instantiate_fit(parser, parser.parse_args(["--config", str(tmp_path / "printed.yaml")]))
    original = instantiate_fit(parser, parser.parse_args(["--config", str(grpo)]))
    assert built["module"].rewards.names == original["module"].rewards.names == ["partial_credit"]
    assert built["module"].model_spec.to_dict() == original["module"].model_spec.to_dict()
    assert (built["trainer"].max_steps, built["module"].sampling) == (original["trainer"].max_steps,
                                                                       original["module"].sampling)

"""The config-file CLI (``rltrainer fit --config ...``): the shipped configs parse, match the
recipe's presets, print complete, and a tiny run fits from one."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rltrainer.cli import build_parser, fit_parser, instantiate_fit, main, run_fit, summary

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "recipes" / "configs"
CPU = CONFIGS / "grpo_gsm8k_cpu.yaml"


def load_recipe():
    spec = importlib.util.spec_from_file_location("grpo_gsm8k", ROOT / "recipes" / "grpo_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(*args: str):
    return fit_parser().parse_args(list(args))


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_parse(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs' data paths are relative to the repository root
    config = parse("--config", str(path))
    assert config.module.class_path == "rltrainer.GRPO"
    assert Path(config.data.init_args.train_file).exists()


def test_cpu_config_holds_the_recipes_cpu_preset():
    """recipes/grpo_gsm8k.py --preset cpu and grpo_gsm8k_cpu.yaml are the same run."""
    preset, config = load_recipe().PRESETS["cpu"], yaml.safe_load(CPU.read_text())
    module, trainer, data = config["module"]["init_args"], config["trainer"], config["data"]
    strategy = trainer["strategy"]["init_args"]
    assert (data["batch_size"], data["max_prompt_length"]) == (preset["batch_size"], preset["max_prompt_length"])
    for key in ("num_generations", "max_new_tokens"):
        assert module[key] == preset[key], key
    (kl,) = module["parts"]  # the settings group and the part, given whole
    assert module["optimizer"]["lr"] == preset["lr"] and kl["init_args"]["kl_coef"] == preset["kl_coef"]
    assert (trainer["max_steps"], trainer["val_check_interval"], trainer["limit_val_batches"]) == (
        preset["max_steps"], preset["val_check_interval"], preset["val_batches"])
    assert (strategy["micro_batch_size"], strategy["precision"]) == (preset["micro_batch_size"], preset["precision"])
    assert config["threads"] == preset["threads"] and module["tokenizer"] == "qwen2.5-instruct"
    from rltrainer.testing import tiny_qwen2_config

    tiny = tiny_qwen2_config(151665).to_dict()
    assert all(tiny[k] == v for k, v in module["model"]["init_args"].items())


def test_flags_override_every_layer_and_print_config_is_complete(capsys, tmp_path):
    """A trainer, a module, a strategy and a data argument set as flags; --print_config writes them
    with every default, and the printed config parses back to the same settings."""
    flags = ["--config", str(CPU), "--trainer.max_steps", "3", "--module.init_args.temperature", "0.7",
             "--trainer.strategy.init_args.gradient_clip_val", "0.5", "--data.batch_size", "2",
             "--trainer.pipeline", "AsyncPipeline", "--trainer.pipeline.max_staleness", "1"]
    config = parse(*flags)
    assert config.trainer.max_steps == 3 and config.module.init_args.temperature == 0.7
    assert config.trainer.strategy.init_args.gradient_clip_val == 0.5 and config.data.init_args.batch_size == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fit", *flags, "--print_config"])
    printed = capsys.readouterr().out
    written = yaml.safe_load(printed)
    assert written["trainer"]["pipeline"]["init_args"]["staleness_policy"] == "wait"  # a default the config never set
    assert written["module"]["init_args"]["parts"][0]["init_args"]["kl_estimator"] == "k3"  # nor these two
    assert written["module"]["init_args"]["optimizer"]["weight_decay"] == 0.01
    assert written["trainer"]["strategy"]["init_args"]["max_tokens_per_micro_batch"] is None
    (tmp_path / "printed.yaml").write_text(printed)
    again = parse("--config", str(tmp_path / "printed.yaml"))
    assert again.as_dict() == config.as_dict() | {"config": again.as_dict()["config"]}


def test_a_strategy_by_name_and_a_bad_value_is_refused():
    config = parse("--config", str(CPU), "--trainer.strategy", "fsdp2")
    assert config.trainer.strategy == "fsdp2"
    with pytest.raises(Exception, match="max_steps"):
        parse("--config", str(CPU), "--trainer.max_steps", "many")


def test_a_tiny_run_fits_from_the_shipped_config_and_ends_with_a_summary(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["fit", "--config", str(CPU), "--trainer.max_steps", "1", "--trainer.val_check_interval", "1",
            "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.enable_progress_bar", "false", "--module.init_args.max_new_tokens", "8",
            "--module.init_args.num_generations", "2", "--data.batch_size", "2",
            "--data.limit_train_rows", "4", "--data.limit_val_rows", "2"]
    parser = fit_parser()
    trainer = run_fit(instantiate_fit(parser, parser.parse_args(argv[1:])))
    assert trainer.global_step == 1
    assert {"val/accuracy", "critic/score/mean"} <= set(trainer.callback_metrics)
    (log_dir,) = tmp_path.glob("lightning_logs/version_*")
    assert (log_dir / "metrics.csv").is_file()
    assert (tmp_path / "checkpoints" / "step=1.ckpt").is_dir()  # the CLI adds a ModelCheckpoint
    text = summary(trainer, 12.3, argv)
    assert text.startswith("rltrainer fit done: 1/1 steps in 12 s") and "resume" not in text
    assert "critic/score/mean" in text and "val/accuracy" in text
    assert f"logs:         {log_dir}" in text and f"plot:         python -m rltrainer.plot {log_dir}" in text
    assert f"checkpoints:  {tmp_path / 'checkpoints'}" in text


def test_main_returns_an_exit_code_and_prints_the_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["fit", "--config", str(CPU), "--trainer.fast_dev_run", "true", "--trainer.enable_progress_bar",
                 "false", "--trainer.default_root_dir", str(tmp_path), "--module.init_args.max_new_tokens", "4",
                 "--module.init_args.num_generations", "2", "--data.batch_size", "2", "--data.limit_train_rows",
                 "2", "--data.val_file", "null"]) == 0
    assert "rltrainer fit done: 1/1 steps" in capsys.readouterr().out
    assert not (tmp_path / "checkpoints").exists()  # fast_dev_run: no default ModelCheckpoint


def test_python_dash_m_rltrainer_prints_its_help():
    out = subprocess.run([sys.executable, "-m", "rltrainer", "fit", "--help"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "--trainer.max_steps" in out.stdout and "--print_config" in out.stdout


def test_instantiate_fit_hands_the_module_tokenizer_to_the_data(monkeypatch):
    monkeypatch.chdir(ROOT)
    parser = fit_parser()
    built = instantiate_fit(parser, parser.parse_args(["--config", str(CPU), "--trainer.logger", "false"]))
    assert built["data"].tokenizer is built["module"].tokenizer
    assert len(built["module"].tokenizer) == 151665


def test_the_cli_calls_no_deprecated_jsonargparse_method(monkeypatch):
    """jsonargparse 4.49 deprecated ``add_instantiator`` and ``instantiate_classes`` (gone in 5):
    the module's tokenizer string is loaded by an instantiator given to ``instantiate``."""
    import warnings

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "all")  # not only the first of each kind
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parser = fit_parser()
        built = instantiate_fit(parser, parser.parse_args(["--config", str(CPU), "--trainer.logger", "false"]))
    assert not isinstance(built["module"].tokenizer, str)
    deprecated = [str(w.message) for w in caught if "add_instantiator" in str(w.message)
                  or "instantiate_classes" in str(w.message)]
    assert deprecated == []

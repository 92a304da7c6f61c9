"""The config-file command line: ``rltrainer fit --config grpo.yaml`` (or ``python -m rltrainer``), and
``rltrainer validate --config grpo.yaml`` (the same config: validation alone, of the model as
configured or of a checkpoint with ``--ckpt_path``).

Built on jsonargparse, as Lightning's CLI is: the parser is made from the signatures, so every
argument of :class:`~rltrainer.Trainer` (``trainer:``), of the module class (``module:``, a
``class_path`` such as ``rltrainer.GRPO`` or your own ``my_task.MyModule``, with its ``init_args``),
of the strategy (``trainer.strategy``: a registered name or a ``class_path``), of the pipeline
(``trainer.pipeline``: ``sync``, ``one_step_off``, ``async``, or a ``class_path`` such as
``AsyncPipeline`` with its ``init_args``: ``--trainer.pipeline AsyncPipeline
--trainer.pipeline.max_staleness 2``) and of the data
(``data:``: :class:`~rltrainer.data.PromptDataModule`'s arguments, or a ``class_path`` of your own
data module with ``init_args``) can be set in YAML or as a flag (``--trainer.max_steps 5``,
``--module.init_args.optimizer.lr 1e-5``); ``--print_config`` writes the whole resolved config. Reward
functions are named by dotted path (``reward_funcs: [my_task.partial_credit]``); your modules
import from the working directory or the config file's folder. The module's ``tokenizer`` may be a
path, a hub id or a tokenizer shipped in ``recipes/data/tokenizers`` (``qwen2.5-instruct``,
``qwen3``, ``gsm8k-bpe4k``); it is loaded once and also tokenises the prompts.

A run saves checkpoints (a :class:`~rltrainer.ModelCheckpoint` unless ``trainer.callbacks`` has
one); ``--ckpt_path last`` resumes the newest, and Ctrl-C stops after the current step with a
checkpoint and the command that resumes it. With ``trainer.val_check_interval`` the run validates
before the first step too (logged as step 0), so one log holds the starting point and the end.
Shipped configs: ``recipes/configs/``.

``rltrainer serve --model ... --tokenizer ...`` starts the local server that the ``tinker`` SDK
talks to (:mod:`rltrainer.own_loop.server`; its own options, ``rltrainer serve --help``).
"""

from __future__ import annotations

import difflib
import logging
import os
import shlex
import sys
import time
from argparse import ArgumentError
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rltrainer.callbacks import LearningSignal, ModelCheckpoint
from rltrainer.data.datamodule import DataModule
from rltrainer.module import RLModule
from rltrainer.own_loop.server import main as serve
from rltrainer.testing import data_path
from rltrainer.trainer import Trainer

log = logging.getLogger(__name__)

#: The tokenizers shipped in ``recipes/data/tokenizers``, loadable by name.
SHIPPED_TOKENIZERS = ("qwen2.5-instruct", "qwen3", "gsm8k-bpe4k")
#: Exit codes: a usage error (as argparse), a run stopped by Ctrl-C (as a shell).
USAGE_ERROR, INTERRUPTED = 2, 130
#: Metrics the end-of-run summary shows when the run logged them (plus every ``val/`` one).
SUMMARY_METRICS = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "timing_s/step")


def load_tokenizer_spec(spec: Any) -> Any:
    """A tokenizer from a shipped name, a local path or a hub id; anything else is returned as is."""
    if not isinstance(spec, str):
        return spec
    from transformers import AutoTokenizer

    if spec in SHIPPED_TOKENIZERS:
        spec = str(data_path("tokenizers", spec))
    return AutoTokenizer.from_pretrained(spec)


def _instantiate_module(class_type: type, *args: Any, **kwargs: Any) -> Any:
    """jsonargparse's instantiator for RLModule classes: the ``tokenizer`` string is loaded first."""
    if "tokenizer" in kwargs:
        kwargs["tokenizer"] = load_tokenizer_spec(kwargs["tokenizer"])
    return class_type(*args, **kwargs)


#: The subcommands: what each does, and what its ``--ckpt_path`` means.
COMMANDS = {
    "fit": ("Train an RLModule with the Trainer, from a config file and flags.",
            "resume from this checkpoint directory, or 'last': the newest one the run's ModelCheckpoint wrote "
            "(none yet: start from scratch)"),
    "validate": ("Validate an RLModule (its validation_step over data.val_file), from the same config file as fit: "
                 "the model as configured, or a checkpoint's.",
                 "validate this checkpoint directory's policy, or 'last': the newest one of the run (none: the "
                 "model as configured)"),
}


def fit_parser(command: str = "fit") -> Any:
    """The ``fit`` (or ``validate``: the same arguments) subcommand's parser: ``--config``,
    ``trainer``, ``module``, ``data``, ``ckpt_path``, ``threads``, ``log_level``."""
    try:
        from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
    except ImportError as exc:
        raise ImportError("The rltrainer command line needs jsonargparse, a dependency of rltrainer that is missing "
                          "from this environment: pip install 'jsonargparse>=4.53,<5' (or reinstall rltrainer)") from exc

    description, ckpt_help = COMMANDS[command]
    parser = ArgumentParser(description=description, exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML config (several: later ones override)")
    parser.add_argument("--ckpt_path", type=str | None, default=None, help=ckpt_help)
    parser.add_argument("--threads", type=int | None, default=None,
                        help="torch.set_num_threads in the controller (default: torch's)")
    parser.add_argument("--log_level", type=str, default="INFO", help="the logging level of the run")
    parser.add_class_arguments(Trainer, "trainer")
    parser.add_subclass_arguments(RLModule, "module", required=True,
                                  help="the RLModule: class_path (rltrainer.GRPO, rltrainer.DAPO, rltrainer.PPO, "
                                       "or your own) and init_args")
    parser.add_subclass_arguments(DataModule, "data", required=True,
                                  default=Namespace(class_path="rltrainer.data.PromptDataModule"),
                                  help="the prompts: PromptDataModule's arguments (train_file, format, "
                                       "prompt_column...), or class_path and init_args of your own data module "
                                       "(train_dataloader(), optionally val_dataloader() and setup(tokenizer))")
    return parser


def build_parser(fit: Any = None, validate: Any = None) -> Any:
    """``rltrainer`` with its subcommands (``fit``: ``fit`` or a new :func:`fit_parser`; ``validate``
    likewise)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="rltrainer", description=__doc__.split("\n\n")[0], exit_on_error=False)
    subcommands = parser.add_subcommands(dest="subcommand")
    subcommands.add_subcommand("fit", fit if fit is not None else fit_parser(), help="train from a config file and flags")
    subcommands.add_subcommand("validate", validate if validate is not None else fit_parser("validate"),
                               help="validate the model as configured, or a checkpoint (--ckpt_path), from the same "
                                    "config")
    return parser


def instantiate_fit(parser: Any, config: Any) -> dict[str, Any]:
    """``trainer``, ``module`` and ``data`` built from a parsed ``fit`` config: the data gets the
    module's tokenizer (``setup(tokenizer)``, if it has one), and the trainer a
    :class:`~rltrainer.ModelCheckpoint` if it has none (but for a ``fast_dev_run``)."""
    objects = parser.instantiate(config, instantiators=[(_instantiate_module, RLModule, True)])
    if hasattr(objects.data, "setup"):
        objects.data.setup(objects.module.tokenizer)
    trainer = objects.trainer
    if not trainer.fast_dev_run and not any(isinstance(c, ModelCheckpoint) for c in trainer.callbacks):
        trainer.callbacks.append(ModelCheckpoint())
    return {"trainer": trainer, "module": objects.module, "data": objects.data}


def run_fit(built: dict[str, Any], ckpt_path: str | None = None) -> Any:
    """``fit`` the run :func:`instantiate_fit` built; returns the Trainer (torn down)."""
    with built["trainer"] as trainer:
        trainer.fit(built["module"], datamodule=built["data"], ckpt_path=ckpt_path)
    return trainer


def validation_prompts(data: Any) -> Any:
    """``data.val_dataloader()``; a ``ValueError`` if the data has none."""
    loader = data.val_dataloader() if hasattr(data, "val_dataloader") else None
    if loader is None:
        raise ValueError("rltrainer validate needs validation prompts, and the data has none: set data.val_file "
                         "(or give your data module a val_dataloader()).")
    return loader


def run_validate(built: dict[str, Any], loader: Any, ckpt_path: str | None = None) -> dict[str, float]:
    """``validate`` the run :func:`instantiate_fit` built over ``loader`` (:func:`validation_prompts`):
    its policy as configured, or the checkpoint ``ckpt_path``'s (a path, or ``"last"``); the metrics
    are logged at the step validated (0, or the checkpoint's). Returns them."""
    trainer, module = built["trainer"], built["module"]
    with trainer:
        if ckpt_path is not None:
            trainer.restore(module, ckpt_path)  # "last" with no checkpoint yet: the model as configured
        return trainer.validate(module, loader)


def validate_summary(trainer: Any, metrics: dict[str, float], seconds: float) -> str:
    """The lines ``rltrainer validate`` ends with: what was validated, its metrics, where they are logged."""
    what = f"checkpoint {trainer.ckpt_path} (step {trainer.ckpt_step})" if trainer.ckpt_path is not None else \
        "the model as configured (step 0)"
    lines = [f"rltrainer validate done: {what} in {seconds:.0f} s",
             "  metrics:      " + (", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())) or "none")]
    for logger in trainer.loggers:
        if where := getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None):
            lines.append(f"  logs:         {where}")
    return "\n".join(lines)


def import_paths(argv: Sequence[str]) -> list[str]:
    """Where a user's modules and classes named in a config are imported from: the working directory,
    then the folder of each ``--config`` file (looked in after the installed packages, so a file there
    named like one of them does not hide it)."""
    paths = [os.getcwd(), *(str(Path(value).expanduser().resolve().parent) for value in config_files(argv))]
    return list(dict.fromkeys(paths))


def config_files(argv: Sequence[str]) -> list[str]:
    """The ``--config`` files of a command line, in order."""
    return [arg.split("=", 1)[1] if arg.startswith("--config=") else argv[i + 1] for i, arg in enumerate(argv)
            if arg.startswith("--config=") or (arg == "--config" and i + 1 < len(argv))]


def config_file_problem(argv: Sequence[str]) -> str | None:
    """What is wrong with a ``--config`` file that is not a mapping of sections (empty, comments
    only, a list), which jsonargparse reports as ``Unexpected config:`` and the file's text."""
    for name in config_files(argv):
        try:
            lines = [line for line in Path(name).expanduser().read_text().splitlines()
                     if line.strip() and not line.lstrip().startswith(("#", "---"))]
        except OSError:  # the parser says it: missing, unreadable
            continue
        if not lines or not any(":" in line and not line.startswith((" ", "-")) for line in lines):
            what = ("is empty (or holds only comments)" if not lines else
                    "holds a list" if lines[0].startswith("-") else f"holds no section (it starts {lines[0]!r})")
            return (f"the config file {name} {what}: a config is a YAML mapping of sections, at least `module:` "
                    "(class_path and init_args: model, tokenizer, reward_funcs) and `data:` (train_file...), and "
                    "`trainer:` for the run's length. Start from a shipped one (recipes/configs/grpo_gsm8k_cpu.yaml; "
                    "the CLI page of the docs builds one step by step), or print every setting of one that works "
                    "with --print_config")
    return None


def resume_command(argv: Sequence[str]) -> str:
    """The command that resumes this run: ``argv`` with ``--ckpt_path last`` (instead of its own)."""
    args, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--ckpt_path="):
            skip = False
            continue
        skip = arg == "--ckpt_path"
        if not skip:
            args.append(arg)
    return shlex.join(["rltrainer", *args, "--ckpt_path", "last"])


def summary(trainer: Any, seconds: float, argv: Sequence[str]) -> str:
    """A few lines at the end of a run: steps, wall time, the last metrics, where its outputs are, and
    the warnings of :class:`~rltrainer.LearningSignal` (a run that cannot learn)."""
    state = "interrupted after" if trainer.interrupted else "done:"
    steps = f"{trainer.global_step}" + (f"/{trainer.max_steps}" if trainer.max_steps != -1 else "")
    lines = [f"rltrainer fit {state} {steps} steps in {seconds:.0f} s"]
    if trainer.ckpt_path is not None:  # as given ("last.ckpt" points to a newer one by now): its step says which
        lines.append(f"  resumed from: {trainer.ckpt_path} (step {trainer.ckpt_step})")
    metrics = trainer.callback_metrics
    shown = [k for k in SUMMARY_METRICS if k in metrics] + sorted(k for k in metrics if k.startswith("val/"))
    if shown:
        lines.append("  last metrics: " + ", ".join(f"{k} {metrics[k]:.4g}" for k in shown))
    for logger in trainer.loggers:
        where = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        if where:
            lines.append(f"  logs:         {where}")
            if (Path(where) / "metrics.csv").is_file():
                lines.append(f"  plot:         python -m rltrainer.plot {shlex.quote(str(where))}")
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            lines.append(f"  checkpoints:  {callback.run_dir(trainer)}")
            if callback.best_model_path is not None:
                lines.append(f"  best:         {callback.best_model_path} ({callback.monitor} "
                             f"{callback.best_model_score:.4g})")
    if trainer.interrupted:
        lines.append(f"  resume with:  {resume_command(argv)}")
    warned = [w for c in trainer.callbacks if isinstance(c, LearningSignal) for w in c.warnings]
    lines += [f"  warning:      {w}" for w in warned]  # said during the run too, easy to miss above
    return "\n".join(lines)


#: Lines of jsonargparse's messages that say nothing to a user (a class argument is ``Optional``).
NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:",
         "Expected a <class 'NoneType'>", "Given value type:", "Given value:")


def usage_error(exc: BaseException, command: str, options: Sequence[str] = ()) -> str:
    """One readable message for a command line or config the parser (or a constructor) refused;
    an unknown flag gets the closest of ``options``."""
    lines = [line.strip().removeprefix("- ") for line in str(exc).strip().splitlines()]
    lines = [line for line in lines if line and not line.startswith(NOISE)]
    if len(lines) > 12:
        lines = [*lines[:12], f"  ... ({len(lines) - 12} more lines)"]
    message = "\n  ".join(lines)
    if not isinstance(exc, ArgumentError):  # a constructor's
        message = f"{type(exc).__name__}: {message}"
    unknown = [a.split("=", 1)[0] for a in message.split() if a.startswith("--")] if "unrecognized" in message else []
    close = [m for a in unknown for m in difflib.get_close_matches(a, options, n=1)]
    hint = f"Did you mean {', '.join(close)}? " if close else ""
    classes = f" (and e.g. `{command} --module.help rltrainer.GRPO` for a class's arguments)" if " " in command else ""
    return f"{command}: error: {message}\n{hint}See `{command} --help` for the options{classes}."


def main(argv: Sequence[str] | None = None) -> int:
    """The ``rltrainer`` console script: 0 when the run is done, 130 when Ctrl-C stopped it (with a
    checkpoint), 2 for a command line or config that is refused (one message, no traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # the local Tinker server has plain options of its own
        return serve(argv[1:], prog="rltrainer serve")
    sys.path += [p for p in import_paths(argv) if p not in sys.path]  # after the installed packages
    parsers = {name: fit_parser(name) for name in COMMANDS}
    parser = build_parser(**parsers)
    try:
        config = parser.parse_args(argv)
    except ArgumentError as exc:
        command = argv[0] if argv[:1] and argv[0] in parsers else None
        options = list(getattr(parsers[command], "_option_string_actions", {})) if command else []
        problem = config_file_problem(argv) if "Unexpected config" in str(exc) else None
        print(usage_error(ArgumentError(None, problem) if problem else exc,
                          f"rltrainer {command}" if command else "rltrainer", options), file=sys.stderr)
        return USAGE_ERROR
    if config.subcommand not in parsers:
        print(parser.format_usage(), file=sys.stderr)
        return USAGE_ERROR
    command = config.subcommand
    sub, config = parsers[command], getattr(config, command)
    logging.basicConfig(level=getattr(logging, str(config.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(name)s: %(message)s")
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    start = time.perf_counter()
    try:  # a constructor refusing a value is a usage error too (an error while training is not)
        built = instantiate_fit(sub, config)
    except (ValueError, TypeError, ImportError, OSError) as exc:
        log.debug("The config was refused", exc_info=exc)
        print(usage_error(exc, f"rltrainer {command}"), file=sys.stderr)
        return USAGE_ERROR
    if command == "validate":
        return main_validate(built, config.ckpt_path, start)
    try:
        trainer = run_fit(built, config.ckpt_path)
    except KeyboardInterrupt:  # a second Ctrl-C (or one before training started): no checkpoint of this step
        print(f"rltrainer fit: stopped at once at step {built['trainer'].global_step}, without saving it. Resume "
              f"from the newest checkpoint (if any) with:\n  {resume_command(argv)}", file=sys.stderr)
        return INTERRUPTED
    print(summary(trainer, time.perf_counter() - start, argv))
    return INTERRUPTED if trainer.interrupted else 0


def main_validate(built: dict[str, Any], ckpt_path: str | None, start: float) -> int:
    """``rltrainer validate``: 0 with the metrics printed; 2 where the data has no validation prompts."""
    try:
        loader = validation_prompts(built["data"])
    except ValueError as exc:
        print(usage_error(exc, "rltrainer validate"), file=sys.stderr)
        return USAGE_ERROR
    metrics = run_validate(built, loader, ckpt_path)
    print(validate_summary(built["trainer"], metrics, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())

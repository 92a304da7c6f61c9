"""The config-file command line: ``rltrainer fit --config grpo.yaml`` (or ``python -m rltrainer``).

Built on jsonargparse, as Lightning's CLI is: the parser is made from the signatures, so every
argument of :class:`~rltrainer.Trainer` (``trainer:``), of the module class (``module:``, a
``class_path`` such as ``rltrainer.GRPO`` with its ``init_args``), of the strategy
(``trainer.strategy``: a registered name or a ``class_path``) and of
:class:`~rltrainer.data.datamodule.PromptDataModule` (``data:``) can be set in YAML or as a flag
(``--trainer.max_steps 5``, ``--module.init_args.lr 1e-5``); ``--print_config`` writes the whole
resolved config. The module's ``tokenizer`` may be a path, a hub id or a tokenizer shipped in
``recipes/data/tokenizers`` (``qwen2.5-instruct``, ``qwen3``, ``gsm8k-bpe4k``); it is loaded once
and also tokenises the prompts. Shipped configs: ``recipes/configs/``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

#: The tokenizers shipped in ``recipes/data/tokenizers``, loadable by name.
SHIPPED_TOKENIZERS = ("qwen2.5-instruct", "qwen3", "gsm8k-bpe4k")


def load_tokenizer_spec(spec: Any) -> Any:
    """A tokenizer from a shipped name, a local path or a hub id; anything else is returned as is."""
    if not isinstance(spec, str):
        return spec
    from transformers import AutoTokenizer

    if spec in SHIPPED_TOKENIZERS:
        from rltrainer.testing import data_path

        spec = str(data_path("tokenizers", spec))
    return AutoTokenizer.from_pretrained(spec)


def _instantiate_module(class_type: type, *args: Any, **kwargs: Any) -> Any:
    """jsonargparse's instantiator for RLModule classes: the ``tokenizer`` string is loaded first."""
    if "tokenizer" in kwargs:
        kwargs["tokenizer"] = load_tokenizer_spec(kwargs["tokenizer"])
    return class_type(*args, **kwargs)


def fit_parser() -> Any:
    """The ``fit`` subcommand's parser: ``--config``, ``trainer``, ``module``, ``data``, ``threads``."""
    try:
        from jsonargparse import ActionConfigFile, ArgumentParser
    except ImportError as exc:
        raise ImportError("The rltrainer command line needs jsonargparse: pip install 'rltrainer[cli]' "
                          "(or pip install 'jsonargparse>=4.53')") from exc

    from rltrainer.data.datamodule import PromptDataModule
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer

    parser = ArgumentParser(description="Train an RLModule with the Trainer, from a config file and flags.",
                            exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML config (several: later ones override)")
    parser.add_argument("--threads", type=int | None, default=None,
                        help="torch.set_num_threads in the controller (default: torch's)")
    parser.add_argument("--log_level", type=str, default="INFO", help="the logging level of the run")
    parser.add_class_arguments(Trainer, "trainer")
    parser.add_subclass_arguments(RLModule, "module", required=True,
                                  help="the RLModule: class_path (rltrainer.GRPO, rltrainer.DAPO, rltrainer.PPO, "
                                       "or your own) and init_args")
    parser.add_class_arguments(PromptDataModule, "data")
    parser.add_instantiator(_instantiate_module, RLModule, subclasses=True)
    return parser


def build_parser(fit: Any = None) -> Any:
    """``rltrainer`` with its subcommands (``fit``: ``fit`` or a new :func:`fit_parser`)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="rltrainer", description=__doc__.split("\n\n")[0], exit_on_error=False)
    subcommands = parser.add_subcommands(dest="subcommand")
    subcommands.add_subcommand("fit", fit if fit is not None else fit_parser(), help="train from a config file and flags")
    return parser


def instantiate_fit(parser: Any, config: Any) -> dict[str, Any]:
    """``trainer``, ``module`` and ``data`` built from a parsed ``fit`` config (the data gets the
    module's tokenizer)."""
    objects = parser.instantiate_classes(config)
    objects.data.setup(objects.module.tokenizer)
    return {"trainer": objects.trainer, "module": objects.module, "data": objects.data}


def run_fit(config: Any, parser: Any) -> Any:
    """Build the run from ``config`` and ``fit`` it; returns the Trainer (torn down)."""
    import torch

    logging.basicConfig(level=getattr(logging, str(config.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(name)s: %(message)s")
    if config.threads:
        torch.set_num_threads(config.threads)
    built = instantiate_fit(parser, config)
    with built["trainer"] as trainer:
        trainer.fit(built["module"], datamodule=built["data"])
    return trainer


def main(argv: Sequence[str] | None = None) -> Any:
    """The ``rltrainer`` console script; returns what the subcommand returned (``fit``: the Trainer)."""
    fit = fit_parser()
    parser = build_parser(fit)
    config = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if config.subcommand == "fit":
        return run_fit(config.fit, fit)
    raise SystemExit(parser.format_usage())


if __name__ == "__main__":
    main()

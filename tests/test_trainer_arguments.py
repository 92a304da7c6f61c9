"""The Trainer's arguments: pipelines as objects (names as shorthand), each checking its own
settings; every setting in its owner's constructor (issue 45: no former flat keywords, no
aliases of the module-facing helpers); an unknown keyword named with the closest valid one."""

from __future__ import annotations

import warnings

import pytest

from rltrainer import (AsyncPipeline, LogGenerations, Logger, OneStepOffPipeline, SingleDeviceStrategy, SyncPipeline,
                       Trainer)
from rltrainer.pipelines import PIPELINES, resolve_pipeline
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy

QUIET = dict(logger=False, enable_progress_bar=False)


def split() -> dict:
    """A Trainer's strategy and rollout with the engine in a process of its own."""
    return dict(strategy=FSDP2Strategy(devices=1), rollout=Rollout(placement="split"))


def test_the_constructor_has_at_most_20_parameters():
    import inspect

    named = list(inspect.signature(Trainer).parameters.values())
    assert len(named) <= 20, [p.name for p in named]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in named)  # no **kwargs: every keyword is named
    assert "max_staleness" not in {p.name for p in named}


@pytest.mark.parametrize("name, cls", list(PIPELINES.items()))
def test_a_name_is_shorthand_for_the_pipeline_object_with_its_defaults(name, cls):
    where = split() if name != "sync" else dict(strategy=SingleDeviceStrategy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spellings do not warn
        by_name, by_object = Trainer(**where, pipeline=name, **QUIET), \
            Trainer(**where, pipeline=cls(), **QUIET)
    assert type(by_name.pipeline) is type(by_object.pipeline) is cls
    assert by_name.pipeline == by_object.pipeline and by_name.pipeline.mode == name
    assert by_name.pipeline != (SyncPipeline() if name != "sync" else SyncPipeline(push_mode="background"))
    assert by_name.pipeline != name  # a pipeline is an object; its name is its mode


def test_each_pipeline_checks_its_own_settings_at_construction():
    with pytest.raises(ValueError, match=r"max_staleness must be an int >= 0.*got -1"):
        AsyncPipeline(max_staleness=-1)
    with pytest.raises(ValueError, match=r"staleness_policy='skip'; choose from wait, drop"):
        AsyncPipeline(staleness_policy="skip")
    with pytest.raises(ValueError, match=r"push_mode must be 'wait' or 'background', got 'later'"):
        SyncPipeline(push_mode="later")
    with pytest.raises(ValueError, match=r"pipeline='overlap'; choose from sync, one_step_off, async"):
        resolve_pipeline("overlap")
    with pytest.raises(ValueError, match="split"):  # the pairing with the strategy: checked by the Trainer
        Trainer(pipeline=AsyncPipeline(max_staleness=2), **QUIET)
    assert [SyncPipeline().push_mode, SyncPipeline("background").push_mode, OneStepOffPipeline().push_mode,
            AsyncPipeline().push_mode] == ["wait", "background", "overlap", "overlap"]
    assert repr(AsyncPipeline(2, "drop")) == "AsyncPipeline(max_staleness=2, staleness_policy='drop')"


def test_the_pipeline_the_callback_and_the_logger_carry_their_settings(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = Trainer(**split(), pipeline=AsyncPipeline(max_staleness=2, staleness_policy="drop"),
                    callbacks=[LogGenerations(every_n_steps=7, rows=2)],
                    logger=Logger("csv", project="proj", run_name="run"), default_root_dir=tmp_path,
                    enable_progress_bar=False)
    assert isinstance(t.pipeline, AsyncPipeline)
    assert (t.pipeline.max_staleness, t.pipeline.staleness_policy) == (2, "drop")
    (gen,) = [c for c in t.callbacks if isinstance(c, LogGenerations)]
    assert (gen.every_n_steps, gen.rows) == (7, 2)
    (csv,) = t.loggers
    assert csv.name == "proj" and csv.version == "run"


def test_the_strategy_carries_its_micro_batch_settings():
    t = Trainer(strategy=SingleDeviceStrategy(micro_batch_size=3, padding_free=True), **QUIET)
    assert (t.strategy.micro_batch_size, t.strategy.padding_free) == (3, True)
    assert Trainer(pipeline=SyncPipeline(push_mode="background"), **QUIET).pipeline.push_mode == "background"


def test_the_new_spellings_configure_the_same(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = Trainer(strategy=SingleDeviceStrategy(micro_batch_size=3, padding_free=True),
                    pipeline=SyncPipeline(push_mode="background"), logger=Logger("csv", project="proj", run_name="run"),
                    callbacks=[LogGenerations(every_n_steps=7, rows=2)], default_root_dir=tmp_path,
                    enable_progress_bar=False)
    assert (t.strategy.micro_batch_size, t.strategy.padding_free, t.pipeline.push_mode) == (3, True, "background")
    (gen,) = [c for c in t.callbacks if isinstance(c, LogGenerations)]
    assert (gen.every_n_steps, gen.rows) == (7, 2)
    assert (t.loggers[0].name, t.loggers[0].version) == ("proj", "run")


def test_a_callback_or_logger_setting_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"LogGenerations\(rows=...\): rows must be an int >= 1.*got 0"):
        LogGenerations(rows=0)
    with pytest.raises(ValueError, match=r"Unknown logger 'wandbb'"):
        Logger("wandbb")


def test_an_unknown_keyword_names_the_closest_valid_one():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_step'; did you mean 'max_steps'\?"):
        Trainer(max_step=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_staleness'"):
        Trainer(max_staleness=3)  # the pipeline's: pipeline=AsyncPipeline(max_staleness=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'log_generations_rows'"):
        Trainer(log_generations_rows=2)  # the callback's: callbacks=[LogGenerations(rows=2)]


def test_the_module_facing_helpers_live_with_the_module_and_the_batch(tiny_config, bpe_tokenizer, gsm8k_prompts):
    from rltrainer import GRPO
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.testing import length_reward

    rows = [gsm8k_prompts[i] for i in range(2)]
    assert list(RolloutBatch.from_loader(rows)["prompt_ids"]) == [r["prompt_ids"] for r in rows]
    t = Trainer(max_steps=1, **QUIET)
    assert not [name for name in ("as_batch", "sync_weights", "draw_prompts", "record_generations") if hasattr(t, name)]
    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4)
    with pytest.raises(RuntimeError, match=r"draw_prompts\(\) is only available inside fit\(\)"):
        module.draw_prompts()


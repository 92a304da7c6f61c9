"""The Trainer's arguments after issue 33: pipelines as objects (names as shorthand), each
checking its own settings; the former flat keywords mapped onto their new homes with one
``DeprecationWarning``; an unknown keyword named with the closest valid one; the module-facing
helpers that left the Trainer still answering, with a warning."""

from __future__ import annotations

import warnings

import pytest

from rltrainer import (AsyncPipeline, LogGenerations, Logger, OneStepOffPipeline, SingleDeviceStrategy, SyncPipeline,
                       Trainer)
from rltrainer.data.batch import RolloutBatch
from rltrainer.deprecated import MOVED
from rltrainer.pipelines import PIPELINES, resolve_pipeline
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy

QUIET = dict(logger=False, enable_progress_bar=False)


def split() -> dict:
    """A Trainer's strategy and rollout with the engine in a process of its own."""
    return dict(strategy=FSDP2Strategy(devices=1), rollout=Rollout(placement="split"))


def test_the_constructor_has_at_most_20_parameters():
    import inspect

    named = [p for p in inspect.signature(Trainer).parameters.values() if p.kind is not p.VAR_KEYWORD]
    assert len(named) <= 20, [p.name for p in named]
    assert not set(MOVED) & {p.name for p in named}


@pytest.mark.parametrize("name, cls", list(PIPELINES.items()))
def test_a_name_is_shorthand_for_the_pipeline_object_with_its_defaults(name, cls):
    where = split() if name != "sync" else dict(strategy=SingleDeviceStrategy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spellings do not warn
        by_name, by_object = Trainer(**where, pipeline=name, **QUIET), \
            Trainer(**where, pipeline=cls(), **QUIET)
    assert type(by_name.pipeline) is type(by_object.pipeline) is cls
    assert by_name.pipeline == by_object.pipeline == name and by_name.pipeline.mode == name
    assert by_name.pipeline != ("sync" if name != "sync" else SyncPipeline(push_mode="background"))


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


def test_the_former_keywords_map_onto_their_homes_with_one_warning(tmp_path):
    old = dict(pipeline="async", max_staleness=2, staleness_policy="drop", log_generations_every_n_steps=7,
               log_generations_rows=2, project="proj", run_name="run")
    with pytest.warns(DeprecationWarning) as caught:
        t = Trainer(**split(), logger="csv", default_root_dir=tmp_path, enable_progress_bar=False, **old)
    assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) == 1
    message = str(caught[0].message)
    assert "pipeline=AsyncPipeline(max_staleness=...)" in message and "LogGenerations(rows=...)" in message
    assert "logger=Logger('wandb', project=...)" in message
    assert isinstance(t.pipeline, AsyncPipeline)
    assert (t.pipeline.max_staleness, t.pipeline.staleness_policy) == (2, "drop")
    (gen,) = [c for c in t.callbacks if isinstance(c, LogGenerations)]
    assert (gen.every_n_steps, gen.rows) == (7, 2)
    (csv,) = t.loggers
    assert csv.name == "proj" and csv.version == "run"


def test_the_former_strategy_keywords_configure_a_strategy_built_by_name():
    with pytest.warns(DeprecationWarning, match=r"micro_batch_size= -> strategy=SingleDeviceStrategy"):
        t = Trainer(micro_batch_size=3, padding_free=True, **QUIET)
    assert (t.strategy.micro_batch_size, t.strategy.padding_free) == (3, True)
    with pytest.warns(DeprecationWarning, match="weight_sync"):
        assert Trainer(weight_sync="async", **QUIET).pipeline.push_mode == "background"


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


def test_a_setting_given_twice_is_refused():
    with pytest.raises(ValueError, match=r"set them in its constructor"), pytest.warns(DeprecationWarning):
        Trainer(**split(), pipeline=AsyncPipeline(), max_staleness=3, **QUIET)
    with pytest.raises(ValueError, match=r"configure the callback alone"), pytest.warns(DeprecationWarning):
        Trainer(callbacks=[LogGenerations()], log_generations_rows=2, **QUIET)
    with pytest.raises(ValueError, match=r"LogGenerations\(rows=...\): rows must be an int >= 1.*got 0"):
        LogGenerations(rows=0)
    with pytest.raises(ValueError, match=r"Unknown logger 'wandbb'"):
        Logger("wandbb")


def test_an_unknown_keyword_names_the_closest_valid_one():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_step'; did you mean 'max_steps'\?"):
        Trainer(max_step=3)
    with pytest.raises(TypeError, match=r"'max_stalenes'; did you mean 'max_staleness'\?"):
        Trainer(max_stalenes=3)


def test_the_module_facing_helpers_left_the_trainer_and_still_answer(tiny_config, bpe_tokenizer, gsm8k_prompts):
    from rltrainer import GRPO, prompt_dataloader
    from rltrainer.testing import length_reward

    rows = [gsm8k_prompts[i] for i in range(2)]
    t = Trainer(max_steps=1, **QUIET)
    with pytest.warns(DeprecationWarning, match=r"RolloutBatch.from_loader\(raw\)"):
        batch = t.as_batch(rows)
    assert list(batch["prompt_ids"]) == list(RolloutBatch.from_loader(rows)["prompt_ids"])
    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4)
    with pytest.raises(RuntimeError, match=r"draw_prompts\(\) is only available inside fit\(\)"):
        module.draw_prompts()
    t.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    with pytest.warns(DeprecationWarning, match=r'trainer.sync.push\(trainer.global_step, mode="wait"\)'):
        stats = t.sync_weights()
    assert stats["sync/skipped"] and stats["sync/tensors"] == 0  # the engine already holds these weights
    with pytest.warns(DeprecationWarning, match=r"self.draw_prompts\(\)"), \
            pytest.raises(RuntimeError, match="inside fit"):
        t.draw_prompts()  # after fit: no pipeline runs
    t.teardown()

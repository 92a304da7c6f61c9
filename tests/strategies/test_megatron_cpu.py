"""megatron-core 0.16 on CPU: a tensor-parallel (TP=2, gloo) GPTModel built by the library's
``build_gpt`` (config conversion included), its weights converted from transformers by
``hf_to_megatron``, gives the single-device transformers model's logits, loss and (reduced as the
worker reduces them, converted back) gradients, for Qwen2, a Llama with Llama 3.1's RoPE scaling
and Qwen3. See megatron_tp_check.py for the models and what it takes to run megatron-core without CUDA.

Tolerances: the two layouts compute the same function in a different order (TP splits the
matrix products and gathers the vocabulary; SDPA kernels differ), so values of size ~5 (logits)
differ by a few fp32 ulps accumulated over ~10 ops of width 64-128: observed 1.5e-6 for the
logits, 2e-7 for the gradients; 1e-4 / 1e-5 / 1e-5 leave room, and are far below what a wrong
conversion gives (no RoPE scaling: logits off by 1.3e-2; Qwen3's q/k norm gradients not summed
over TP: gradients off by 2.6e-2).

All five checks run in one pair of rank processes (the ``tp_results`` fixture: one start and
``import megatron`` instead of five); each test reads its own check's result."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("megatron_tp_check.py")
CHECKS = ["qwen2", "llama3-rope", "qwen3", "qwen2:head", "llama3-rope:head"]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="megatron-core is not installed (it is in the dev extra: pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def tp_results():
    """Every check of this module run by one pair of ranks (one process start and ``import megatron``
    for all): ``check -> its result``, or the script's failure (stderr) for the tests to report."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *CHECKS], capture_output=True, text=True, timeout=900,
                          env=env)
    if proc.returncode != 0:
        return proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith('{"check"')]
    return {result["check"]: result for result in results}


def result_of(tp_results, check):
    assert isinstance(tp_results, dict), f"megatron_tp_check.py {' '.join(CHECKS)} failed:\n{tp_results}"
    assert check in tp_results, f"megatron_tp_check.py printed no result for {check!r}: {sorted(tp_results)}"
    return tp_results[check]


@pytest.mark.parametrize("family", ["qwen2", "llama3-rope", "qwen3"])
def test_tensor_parallel_megatron_matches_transformers_on_cpu(family, tp_results):
    result = result_of(tp_results, family)
    assert result["grad_names"] == result["hf_params"]  # every transformers parameter got a gradient back
    assert result["logits_max_abs_diff"] < 1e-4
    assert abs(result["loss_tp2"] - result["loss_hf"]) < 1e-5
    assert result["grad_max_abs_diff"] < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "llama3-rope"])  # tied and untied output layer
def test_vocabulary_parallel_chunked_head_matches_full_logits(family, tp_results):
    """The response tokens' log-probs and entropies from megatron's vocabulary-parallel output
    layer in chunks of 7 tokens (TP=2, temperature 0.7, a left-padded row) equal transformers'
    full-logits path, and so do the gradients of a loss using both (observed: 1.4e-6 and 4.8e-6)."""
    result = result_of(tp_results, f"{family}:head")
    assert result["grad_names"] == result["hf_params"]
    assert result["logits_max_abs_diff"] < 1e-5  # log-probs and entropies
    assert abs(result["loss_tp2"] - result["loss_hf"]) < 1e-5
    assert result["grad_max_abs_diff"] < 2e-5

"""megatron-core 0.16 on CPU: a tensor-parallel (TP=2, gloo) GPTModel built with a layer spec of
our own (CPU attention), its weights converted from transformers by ``hf_to_megatron``, gives the
single-device transformers model's logits, loss and (converted back) gradients. See
megatron_tp_check.py for what it takes to run megatron-core without CUDA."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("megatron_tp_check.py")


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed (it is in the dev extra: pip install -e '.[dev]')")
def test_tensor_parallel_megatron_matches_transformers_on_cpu():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["grad_names"] == 26  # every transformers parameter got a gradient back
    assert result["logits_max_abs_diff"] < 1e-4
    assert abs(result["loss_tp2"] - result["loss_hf"]) < 1e-5
    assert result["grad_max_abs_diff"] < 1e-5

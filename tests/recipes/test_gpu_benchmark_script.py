"""The GPU benchmark script (tests/benchmarks/bench_gpu.py, run by gpu.sh on a lent GPU) runs its
whole path on CPU with a tiny model, so it cannot rot between GPU sessions."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("strategy", ["single", "megatron"])
def test_gpu_benchmark_script_smoke_on_cpu(strategy, tmp_path):
    if strategy == "megatron" and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (dev extra: pip install -e '.[dev]')")
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(ROOT / "tests" / "benchmarks" / "bench_gpu.py"), "--device", "cpu", "--model", "tiny",
           "--steps", "2", "--prompts", "2", "--group", "2", "--max-new-tokens", "8", "--strategy", strategy,
           "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["update_mfu_median"] > 0 and result["decode_tokens_per_s_median"] > 0
    assert result["sync_gb_per_s_median"] > 0 and result["copy_gb_per_s"] > 0
    assert "update MFU" in proc.stdout and "weight sync GB/s" in proc.stdout

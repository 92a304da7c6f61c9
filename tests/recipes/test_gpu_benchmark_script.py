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


def test_gpu_checks_smoke_on_cpu(tmp_path):
    """gpu.sh's other phases: the weight-broadcast group (gloo on CPU, NCCL there) and the engine
    checks (``hf`` here; vLLM and SGLang where installed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "tests" / "benchmarks" / "bench_gpu.py")
    group = subprocess.run([sys.executable, script, "--check", "weight-group", "--device", "cpu", "--mib", "4",
                            "--out", str(tmp_path / "group.json")], capture_output=True, text=True, timeout=120,
                           env=env)
    assert group.returncode == 0, group.stderr[-3000:]
    result = json.loads((tmp_path / "group.json").read_text())
    assert result["bit_exact"] and result["members"] == 2 and result["gb_per_s"] > 0
    engines = subprocess.run([sys.executable, script, "--check", "engines", "--engines", "hf,vllm", "--device", "cpu",
                              "--out", str(tmp_path / "engines.json")], capture_output=True, text=True, timeout=300,
                             env=env)
    assert engines.returncode == 0, engines.stderr[-3000:]
    hf, vllm = json.loads((tmp_path / "engines.json").read_text())["engines"]
    assert hf["ok"] and hf["greedy_n3_rows_equal"] and hf["sleep2_update_generate_same_greedy"]
    assert "ok" in vllm or "not installed" in vllm["skipped"]


def test_gpu_sh_runs_every_phase_within_eight_minutes():
    """The phases' budgets add up to under 8 minutes, and a failed phase fails the script."""
    text = (ROOT / "tests" / "benchmarks" / "gpu.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "tests" / "benchmarks" / "gpu.sh")], check=True)
    budgets = [int(line.split()[2]) * (2 if "$engine" in line else 1) for line in text.splitlines()
               if line.strip().startswith("phase ") and not line.strip().startswith("phase()")]
    assert len(budgets) == 4 and sum(budgets) < 8 * 60 - 20  # grpo, update, weight-group, two engines; 20 s to start
    assert "--check update" in text and "--check weight-group" in text and "--check engines" in text
    assert 'exit 1' in text


def test_update_check_reports_mfu_with_and_without_chunked_head_and_packing(tmp_path):
    """gpu.sh's ``update`` phase on CPU: four variants, each with its MFU."""
    cmd = [sys.executable, str(ROOT / "tests" / "benchmarks" / "bench_gpu.py"), "--check", "update", "--device", "cpu",
           "--model", "tiny", "--prompts", "2", "--group", "2", "--max-new-tokens", "8", "--micro-batch-size", "2",
           "--out", str(tmp_path / "update.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    variants = json.loads((tmp_path / "update.json").read_text())["variants"]
    assert {(v["chunked_head"], v["packed"]) for v in variants} == {(c, p) for c in (True, False) for p in (True, False)}
    assert all(v["mfu"] > 0 for v in variants)
    assert proc.stdout.count("update MFU") == 4

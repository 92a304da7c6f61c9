"""The GPU install paths resolve: pip resolves each one against the package index, as a GPU machine
would, without downloading a wheel (CI runs this from .ci/run; by hand: python .ci/check_gpu_install.py).

| path | requirements | constraints |
| --- | --- | --- |
| trainer, engine elsewhere (split placement) | ``-e ".[dev]"`` | ``.ci/gpu-constraints.txt`` |
| trainer with vLLM colocated | ``-e ".[dev,vllm]"`` | ``.ci/vllm-gpu-constraints.txt`` |
| vLLM's engine environment | what ``python -m rltrainer.rollout.vllm_env --package vllm==0.33.0`` installs | ``.ci/vllm-gpu-constraints.txt`` |
| trainer with SGLang | ``-e ".[dev,sglang]"`` | ``.ci/sglang-gpu-constraints.txt`` |

Each is ``pip install --dry-run --report`` in a throwaway environment, and then it checks that:
every path resolves; a file that pins a whole environment pins every package of its resolution at
the version resolved (so it is complete and current); every side has one Ray version and one NCCL
version (the broadcast weight transport puts trainer rank 0 and the engine in one NCCL group,
which NCCL refuses to form across versions); and pip downloaded no large file.

No wheel is downloaded: pip 26 reads each wheel's metadata from the index's PEP 658 ``.metadata``
file where the index serves one, else (``--use-feature=fast-deps``) with HTTP range requests from
the end of the wheel, and its ``--dry-run`` stops after the resolution. The machine's own pip (23.2
here) downloads every wheel whole even in a dry run (torch 2.14.0 is 555 MB, vLLM 336 MB), so this
runs pip 26.3 in a virtual environment of its own. The machine's pip configuration (local wheel
folders, its caps) is left out (``--isolated``, ``PIP_CONFIG_FILE=/dev/null``): the index alone, as
a GPU machine sees it. Measured on this project's 2-core machine, shared with other jobs: the four
paths in 5 to 6.5 min and 374 MB, 312 MB of it index pages (served uncompressed, with no cache
headers, so each path fetches its own) and the rest wheel tails; one path alone 30 to 110 s. pip
23.2's dry run of vllm==0.33.0 alone downloaded 2.2 GB of whole wheels.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci"
PIP_VERSION = "26.3"
#: a file pip fetched whole larger than this is a wheel it should have read the metadata of
MAX_DOWNLOAD_MB = 20.0
DOWNLOAD = re.compile(r"^\s*Downloading (?P<what>\S+) \((?P<size>[\d.]+) (?P<unit>[kMG]?B)\)", re.M)
UNITS = {"B": 1e-6, "kB": 1e-3, "MB": 1.0, "GB": 1e3}
NCCL = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")


def paths() -> list[tuple[str, list[str], Path, bool]]:
    """``(name, requirements, constraints, whether the file pins the whole environment)``."""
    import importlib.util

    # the builder's own list, read without importing rltrainer (this runs before anything is installed)
    spec = importlib.util.spec_from_file_location("vllm_env", ROOT / "rltrainer" / "rollout" / "vllm_env.py")
    vllm_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_env)
    engine_requirements = vllm_env.engine_requirements
    ray = pins(CI / "gpu-constraints.txt")["ray"]
    return [
        ("trainer (split placement)", ["-e", f"{ROOT}[dev]"], CI / "gpu-constraints.txt", False),
        ("trainer + vLLM (colocated)", ["-e", f"{ROOT}[dev,vllm]", f"ray=={ray}"], CI / "vllm-gpu-constraints.txt", True),
        ("vLLM engine environment", engine_requirements("vllm==0.33.0", ray), CI / "vllm-gpu-constraints.txt", False),
        ("trainer + SGLang", ["-e", f"{ROOT}[dev,sglang]", f"ray=={ray}"], CI / "sglang-gpu-constraints.txt", True),
    ]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(constraints: Path) -> dict[str, str]:
    out = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[canonical(name)] = version
    return out


def resolve(pip: list[str], requirements: list[str], constraints: Path, report: Path, name: str) -> dict[str, str]:
    """The versions pip would install for ``requirements`` under ``constraints``, by name; raises
    with pip's output if it cannot resolve them or downloaded a large file."""
    args = pip + ["install", "--dry-run", "--ignore-installed", "--use-feature=fast-deps", "-v", "--report",
                  str(report), "-c", str(constraints), *requirements]
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    if done.returncode != 0:
        raise SystemExit(f"{name}: pip cannot resolve it:\n{' '.join(args)}\n{done.stdout[-6000:]}")
    large = [(m["what"], float(m["size"]) * UNITS[m["unit"]]) for m in DOWNLOAD.finditer(done.stdout)]
    large = [(what, mb) for what, mb in large if mb > MAX_DOWNLOAD_MB]
    if large:
        raise SystemExit(f"{name}: pip downloaded whole files to resolve ({', '.join(f'{w} {mb:.0f} MB' for w, mb in large)}): "
                         "the index served neither PEP 658 metadata nor HTTP range requests for them")
    installs = json.loads(report.read_text())["install"]
    found = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
    found.pop("rltrainer", None)
    return found


def check(work: Path) -> None:
    venv = work / "venv"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--isolated", "install", "-q",
                           f"pip=={PIP_VERSION}"], capture_output=True, text=True,
                          env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    if done.returncode != 0:
        raise SystemExit(f"cannot install pip {PIP_VERSION} from the package index:\n{done.stdout}{done.stderr}")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--isolated", "--cache-dir", str(work / "cache")]
    failures, seen = [], {}
    for name, requirements, constraints, whole in paths():
        began = time.perf_counter()
        report = work / (re.sub(r"\W+", "-", name).strip("-") + ".json")
        found = seen[name] = resolve(pip, requirements, constraints, report, name)
        nccl = ", ".join(f"{n} {found[n]}" for n in NCCL if n in found) or "none"
        print(f"{name}: resolves ({len(found)} packages, {time.perf_counter() - began:.0f} s): torch "
              f"{found.get('torch')}, transformers {found.get('transformers')}, ray {found.get('ray')}, NCCL {nccl}",
              flush=True)
        if whole:
            pinned = pins(constraints)
            stale = sorted(f"{n}=={v}" for n, v in found.items() if pinned.get(n) != v)
            if stale:
                failures.append(f"{constraints.relative_to(ROOT)} does not pin what {name} resolves to: {stale}")
    for what in ("ray", *NCCL):
        versions = {name: found[what] for name, found in seen.items() if what in found}
        if len(set(versions.values())) > 1:
            failures.append(f"{what} differs across the GPU environments: {versions}")
    if failures:
        raise SystemExit("\n".join(failures))
    print(f"GPU install check: {len(seen)} paths resolve; one Ray and one NCCL version across them")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, default=None, help="keep pip's reports and its environment here")
    args = parser.parse_args(argv)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        check(args.keep)
        return
    with tempfile.TemporaryDirectory(prefix="gpu-install-") as work:
        check(Path(work))


if __name__ == "__main__":
    main()

"""``import rltrainer`` stays light: the optional and heavy libraries load where they are used.

Our own modules import each other at the top (``tests/test_structure.py`` counts the exceptions),
so a heavy third-party import belongs inside the function that needs it, in the module that uses
it (as :mod:`rltrainer.strategies.fsdp2.checkpoint` does with ``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Never loaded by ``import rltrainer`` (nor by importing a strategy's or an engine's modules).
HEAVY = ("lightning", "pytorch_lightning", "ray", "vllm", "sglang", "peft", "tensordict", "megatron",
         "transformers", "torch.distributed.checkpoint", "torch.distributed.fsdp")


def loaded_after(statement: str) -> list[str]:
    """The modules of :data:`HEAVY` a fresh interpreter has loaded after running ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_rltrainer_loads_no_heavy_library() -> None:
    assert loaded_after("import rltrainer") == []


def test_the_rank_and_engine_modules_load_no_heavy_library_either() -> None:
    modules = ("rltrainer.strategies.fsdp2.worker", "rltrainer.strategies.fsdp2.checkpoint",
               "rltrainer.strategies.megatron.worker", "rltrainer.rollout.worker", "rltrainer.toy",
               "rltrainer.testing", "rltrainer.models")
    assert loaded_after("\n".join(f"import {m}" for m in modules)) == []

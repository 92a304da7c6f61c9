"""rltrainer.process_groups: host data (CPU tensors, pickled objects, host barriers) goes over a
group that takes CPU tensors, also where the default group refuses them, as NCCL does on a GPU
(imitated here by rltrainer.testing.nccl_rule); and every collective in rltrainer/ names its group,
or is listed here with the reason its tensors are on the rank's device."""

from __future__ import annotations

import ast
import datetime
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rltrainer.process_groups import host_group, takes_cpu_tensors

PACKAGE = Path(__file__).resolve().parents[1] / "rltrainer"

#: torch.distributed's collectives (what a call on ``dist`` or ``torch.distributed`` is checked for)
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "scatter", "gather", "send", "recv",
    "isend", "irecv", "all_to_all", "all_to_all_single", "batch_isend_irecv", "barrier", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list",
}
#: DTensor's methods that run a collective over the tensor's mesh (no group to name: each is listed).
DTENSOR_COLLECTIVES = {"full_tensor", "redistribute"}
#: Host data by nature: these go over ``host_group()``.
HOST_ONLY = {"barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
             "scatter_object_list", "send_object_list", "recv_object_list"}

#: (file, function, collective) -> why its tensors are on the rank's device, so the default group
#: (NCCL on a GPU, gloo on a CPU) takes them without naming a group.
ON_THE_RANKS_DEVICE = {
    ("strategies/fsdp2/sharding.py", "_scatter_rows", "broadcast"):
        "a 0-dim parameter's value, moved to (or made on) the rank's device",
    ("strategies/fsdp2/sharding.py", "_scatter_rows", "scatter"): "rows made on the rank's device",
    ("strategies/fsdp2/worker.py", "_all_gather", "all_gather_single"):
        "_gather_params moves each shard to self.device and makes the output there",
    ("strategies/fsdp2/worker.py", "_all_gather", "all_gather_into_tensor"): "as all_gather_single",
    ("strategies/megatron/worker.py", "_load", "send"): "tensor.to(self.device)",
    ("strategies/megatron/worker.py", "_replicated", "broadcast"):
        "parameters of a module made with to_empty(device=self.device)",
    ("strategies/megatron/worker.py", "receive", "recv"): "torch.empty(..., device=device), the rank's device",
    ("strategies/strategy.py", "clip_gradients", "full_tensor"):
        "clip_grad_norm_'s norm, on the gradients' device: the mesh's (FSDP2's offloaded CPU gradients take "
        "FSDP2Worker.clip_gradients, over host_group())",
}


def collective_uses() -> list[tuple[str, str, str, int, ast.expr | None]]:
    """``(file, enclosing function, collective, line, its group= argument)`` for every collective in
    rltrainer/: ``dist.<name>`` / ``torch.distributed.<name>``, called or passed on (then with no
    group), ``getattr(dist, "<name>")``, and DTensor's ``full_tensor`` / ``redistribute``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()

        def visit(node: ast.AST, function: str) -> None:
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
                name = _collective_name(child)
                if name:
                    group = _group_argument(node) if isinstance(node, ast.Call) and node.func is child else None
                    found.append((where, function, name, child.lineno, group))
                visit(child, inner)

        tree = ast.parse(path.read_text(), str(path))
        visit(tree, "<module>")
        found += [(where, "<import>", alias.name, node.lineno, None) for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed")
                  for alias in node.names if alias.name in COLLECTIVES]  # a collective imported by name
    return found


def _collective_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and node.attr in DTENSOR_COLLECTIVES:
        return node.attr
    if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and (
            (isinstance(node.value, ast.Name) and node.value.id == "dist")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "distributed")):
        return node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and \
            len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "dist" and \
            isinstance(node.args[1], ast.Constant) and node.args[1].value in COLLECTIVES:
        return node.args[1].value
    return None


def _group_argument(call: ast.Call) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == "group"), None)


def test_every_collective_names_its_group_or_says_why_the_default_group_takes_it():
    """A collective on the default group runs on NCCL on a GPU, which takes CUDA tensors only: each
    names its group (host data: host_group()), or is in ON_THE_RANKS_DEVICE with its reason."""
    uses = collective_uses()
    assert len(uses) > 10  # the scan finds them
    problems, used = [], set()
    for where, function, name, line, group in uses:
        key = (where, function, name)
        if group is None and key in ON_THE_RANKS_DEVICE:
            used.add(key)
        elif group is None:
            problems.append(f"rltrainer/{where}:{line} {function}: dist.{name} on the default group (NCCL on a "
                            "GPU: CUDA tensors only). Pass group=host_group() for host data, or the group of its "
                            "device tensors, or list it in ON_THE_RANKS_DEVICE with the reason.")
        elif name in HOST_ONLY and not (isinstance(group, ast.Call) and getattr(group.func, "id", "") == "host_group"):
            problems.append(f"rltrainer/{where}:{line} {function}: dist.{name} carries host data; pass "
                            "group=host_group() (rltrainer.process_groups)")
    assert not problems, "\n".join(problems)
    assert used == set(ON_THE_RANKS_DEVICE), f"stale ON_THE_RANKS_DEVICE entries: {set(ON_THE_RANKS_DEVICE) - used}"


def test_host_group_is_the_default_group_where_that_takes_cpu_tensors():
    """gloo takes CPU tensors: host_group() is the default group (None). A group of its own is
    made once per default group, and made anew under a new default group (a reused process)."""
    assert not dist.is_initialized()
    made = []
    for _ in range(2):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            assert takes_cpu_tensors() and host_group() is None
            own = host_group(own="background")
            assert host_group(own="background") is own and dist.get_backend(own) == "gloo"
            value = torch.ones(1)
            dist.all_reduce(value, group=own)
            made.append(own)
        finally:
            dist.destroy_process_group()
    assert made[0] is not made[1]


def _rank_under_nccl_rule(rank: int, port: int, out: str) -> None:
    from rltrainer.models.build import share_rng_state
    from rltrainer.strategies.megatron.checkpoint import _global_step
    from rltrainer.testing.nccl_rule import nccl_rule

    torch.set_num_threads(1)
    report = {}
    with nccl_rule():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        try:
            dist.all_reduce(torch.zeros(1))  # a CPU tensor on the default group
        except RuntimeError as exc:
            report["default group"] = str(exc)
        report["takes cpu"] = takes_cpu_tensors()
        report["host backend"] = dist.get_backend(host_group())
        report["step"] = _global_step(SimpleNamespace(step_count=lambda: 3.0 if rank == 0 else 0.0))
        torch.manual_seed(rank)
        share_rng_state()  # rank 0's RNG state on every rank
        report["draw"] = torch.rand(1).item()
        parts = [None, None]
        dist.all_gather_object(parts, {"rank": rank}, group=host_group())
        report["parts"] = parts
        report["own"] = host_group(own="background") is not host_group()
        torch.save(report, f"{out}.{rank}")
        dist.barrier(group=host_group())  # both ranks done before either tears down (rank 0 holds the store)
        dist.destroy_process_group()


def test_host_collectives_run_where_the_default_group_refuses_cpu_tensors(tmp_path):
    """Two ranks whose default group refuses CPU tensors, as NCCL does: the megatron checkpoint's
    step count (a MAX over ranks), the random init's RNG state and pickled objects go over
    host_group(), a gloo group of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp_path, "rank")
    mp.spawn(_rank_under_nccl_rule, args=(port, out), nprocs=2)
    reports = [torch.load(f"{out}.{r}") for r in range(2)]
    for report in reports:
        assert report["default group"] == "No backend type associated with device type cpu"  # torch's, as under NCCL
        assert not report["takes cpu"] and report["host backend"] == "gloo" and report["own"]
        assert report["step"] == 3.0
        assert report["parts"] == [{"rank": 0}, {"rank": 1}]
    assert reports[0]["draw"] == reports[1]["draw"]


def test_a_gpu_rank_makes_its_gpu_current_before_it_joins_nccl(monkeypatch):
    """NCCL's barrier and torch's object collectives (checkpointing's among them) use the current
    CUDA device: a rank on ``cuda:1`` makes that current before it joins the default group."""
    from rltrainer.rollout.worker import Worker

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", torch.device(device))))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append(("init", backend)))
    Worker(rank=0, world_size=1, device="cuda:1").init_distributed("127.0.0.1", 0)
    assert calls == [("set_device", torch.device("cuda:1")), ("init", "nccl")]

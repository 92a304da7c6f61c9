"""Two Ray nodes on one machine (Ray's own ``ray.cluster_utils.Cluster``): FSDP2 places one rank on
each, trains and syncs weights across them, and a node that leaves raises ``WorkerError``.

It runs in a subprocess: the cluster is a Ray instance of its own, and the test session shares one
(``ray_session``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    worker_node = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()

    from rltrainer import GRPO, FSDP2Strategy, Trainer, prompt_dataloader
    from rltrainer.controller import WorkerError
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.testing import data_path, length_reward, load_tokenizer, tiny_qwen2_config

    tokenizer = load_tokenizer("gsm8k-bpe4k")
    rows = prepare_gsm8k(load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(8)), tokenizer,
                         max_prompt_length=160)
    module = GRPO(tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=2), tokenizer,
                  reward_funcs=length_reward, num_generations=2, max_new_tokens=4, lr=1e-3)
    trainer = Trainer(strategy=FSDP2Strategy(devices=1, num_nodes=2, threads_per_worker=1), rollout="hf",
                      max_steps=1, logger=False, enable_progress_bar=False)
    out = {}
    trainer.fit(module, prompt_dataloader(rows, batch_size=2))
    group = trainer.strategy.group
    out["nodes"] = sorted(set(placement_group_table(group.placement_group)["bundles_to_node_id"].values()))
    out["cluster_nodes"] = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    out["step"], out["engine_version"] = trainer.global_step, trainer.engine.weight_version
    out["sync"] = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("sync/")}
    cluster.remove_node(worker_node)
    trainer.max_steps = 2
    try:
        trainer.fit(module, prompt_dataloader(rows, batch_size=2))
        out["after_leave"] = "no error"
    except WorkerError as error:
        out["after_leave"] = f"WorkerError: {str(error)[:300]}"
    trainer.teardown()
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(out))
''')


def test_two_node_placement_trains_syncs_and_a_leaving_node_raises():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert len(out["nodes"]) == 2 and out["nodes"] == out["cluster_nodes"], out  # one rank on each node
    assert out["step"] == 1 and out["engine_version"] == 1, out  # trained, and the engines hold the new weights
    assert out["sync"]["sync/tensors"] > 0, out
    assert out["after_leave"].startswith("WorkerError"), out

"""The local server (rltrainer.own_loop.server) driven by the unchanged tinker SDK 0.38, against the
same calls in process."""

from __future__ import annotations

import pytest
import torch

from rltrainer.own_loop import AdamParams, Datum, TrainingClient
from rltrainer.testing import data_path

tinker = pytest.importorskip("tinker", reason="the server's tests drive the tinker SDK: pip install tinker==0.38.0")

SEQ = [5, 9, 13, 22, 31, 7]


def rl_datum(seq: list[int]) -> dict:
    n = len(seq) - 1
    return {"model_input": seq[:-1], "target_tokens": seq[1:], "logprobs": [-2.0] * n,
            "advantages": [0.0] + [1.0] * (n - 1)}


def test_the_sdk_trains_samples_and_saves_through_the_server(server, bpe_tokenizer, tiny_config, tmp_path):
    state, url = server
    service = tinker.ServiceClient(base_url=url)
    training = service.create_lora_training_client(base_model="rltrainer/tiny", rank=8).result()
    info = training.get_info()
    assert (info.is_lora, info.lora_rank, info.model_data.model_name) == (True, 8, "rltrainer/tiny")
    assert len(training.get_tokenizer()) == len(bpe_tokenizer)  # the local folder, offline

    d = rl_datum(SEQ)
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(d["model_input"]),
                               loss_fn_inputs={k: d[k] for k in ("target_tokens", "logprobs", "advantages")})
    fb = training.forward_backward([datum], "importance_sampling")
    step = training.optim_step(tinker.types.AdamParams(learning_rate=1e-2))  # submitted before fb is done
    out, stepped = fb.result(), step.result()

    # the same calls in process, on the same model and seed
    local = TrainingClient(tiny_config, bpe_tokenizer, rank=8, root=tmp_path / "local", device="cpu")
    same = local.forward_backward([Datum(d["model_input"], {k: torch.tensor(d[k]) for k in
                                                            ("target_tokens", "logprobs", "advantages")})],
                                  "importance_sampling").result()
    local.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert out.metrics["loss:sum"] == pytest.approx(same.metrics["loss:sum"], rel=1e-6)
    torch.testing.assert_close(out.loss_fn_outputs[0]["logprobs"].to_torch(), same.loss_fn_outputs[0]["logprobs"],
                               rtol=0, atol=0)
    served = state.models[training.model_id].client.result()
    for (name, p), q in zip(served.strategy.module.policy.named_parameters(),
                            local.strategy.module.policy.parameters()):
        assert torch.equal(p, q), name
    assert stepped.metrics["optim/step:max"] == 1.0

    sampler = training.save_weights_and_get_sampling_client().result()
    samples = sampler.sample(tinker.types.ModelInput.from_ints(SEQ[:3]), 2,
                             tinker.types.SamplingParams(max_tokens=4, seed=0, stop=[])).result()
    assert [len(s.tokens) for s in samples.sequences] == [4, 4]
    assert all(len(s.logprobs) == 4 and s.stop_reason == "length" for s in samples.sequences)
    logprobs = sampler.compute_logprobs(tinker.types.ModelInput.from_ints(SEQ)).result()
    trained = local.forward([Datum(SEQ[:-1], {"target_tokens": torch.tensor(SEQ[1:])})]).result()
    assert logprobs[0] is None
    torch.testing.assert_close(torch.tensor(logprobs[1:]), trained.loss_fn_outputs[0]["logprobs"],
                               rtol=1e-5, atol=1e-5)

    saved = training.save_state("ckpt-1").result()
    assert saved.path == f"tinker://{training.model_id}/weights/ckpt-1"
    resumed = service.create_training_client_from_state_with_optimizer(saved.path).result()
    assert resumed.get_info().lora_rank == 8
    for p, q in zip(state.models[resumed.model_id].client.result().strategy.module.policy.parameters(),
                    served.strategy.module.policy.parameters()):
        assert torch.equal(p, q)
    rest = tinker.RestClient(base_url=url)
    assert rest.get_weights_info_by_tinker_path(saved.path).result().lora_rank == 8
    assert {r.training_run_id for r in rest.list_training_runs().result().training_runs} == \
        {training.model_id, resumed.model_id}
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [saved.path]
    rest.delete_checkpoint_from_tinker_path(saved.path).result()
    assert rest.list_checkpoints(training.model_id).result().checkpoints == []
    service.close("success")


def test_a_failed_call_reaches_the_sdk_as_an_error(server):
    _, url = server
    service = tinker.ServiceClient(base_url=url)
    with pytest.raises(Exception, match="This server trains 'rltrainer/tiny'.*got base_model='Qwen/Qwen3-8B'"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    training = service.create_lora_training_client(base_model="rltrainer/tiny", rank=4).result()
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([1, 2]),
                               loss_fn_inputs={"target_tokens": [2, 3]})  # ppo needs logprobs and advantages
    with pytest.raises(Exception, match="lacks \\['logprobs', 'advantages'\\]"):
        training.forward_backward([datum], "ppo").result()


def test_rltrainer_serve_starts_a_server_the_sdk_trains_through(bpe_tokenizer, tiny_config, tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_config).save_pretrained(tmp_path / "tiny")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rltrainer", "serve", "--model", str(tmp_path / "tiny"),
                             "--tokenizer", str(data_path("tokenizers", "gsm8k-bpe4k")), "--name", "rltrainer/tiny", "--port", "0"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("Serving rltrainer/tiny on http://127.0.0.1:"), line
        url = line.split(" on ")[1].split(" ")[0]
        monkeypatch.setenv("TINKER_API_KEY", "tml-local")
        monkeypatch.setenv("TINKER_TELEMETRY", "0")
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        training = tinker.ServiceClient(base_url=url).create_lora_training_client(base_model="rltrainer/tiny",
                                                                                  rank=4).result()
        datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(SEQ[:-1]),
                                   loss_fn_inputs={"target_tokens": SEQ[1:]})
        out = training.forward([datum], "cross_entropy").result()
        assert out.metrics["loss:sum"] > 0 and len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(SEQ) - 1
        assert training.get_tokenizer().encode("12 + 3") == bpe_tokenizer.encode("12 + 3")
    finally:
        proc.terminate()
        proc.wait(timeout=30)

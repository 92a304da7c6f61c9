"""The local server (rltrainer.own_loop.server) driven by the unchanged tinker SDK 0.38, against the
same calls in process."""

from __future__ import annotations

import math
from pathlib import Path

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
    with tinker.ServiceClient(base_url=url) as service:  # closed before the server stops: its heartbeat ends
        sdk_trains_samples_and_saves(service, state, url, bpe_tokenizer, tiny_config, tmp_path)


def sdk_trains_samples_and_saves(service, state, url, bpe_tokenizer, tiny_config, tmp_path):
    training = service.create_lora_training_client(base_model=state.name, rank=8).result()
    info = training.get_info()
    assert (info.is_lora, info.lora_rank, info.model_data.model_name) == (True, 8, state.name)
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


def test_a_failed_call_reaches_the_sdk_as_an_error(server):
    state, url = server
    with tinker.ServiceClient(base_url=url) as service:
        with pytest.raises(Exception, match=f"This server trains '{state.name}'.*got base_model='Qwen/Qwen3-8B'"):
            service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
        with pytest.raises(Exception, match="got base_model='Qwen/Qwen3-8B'"):
            service.create_sampling_client(base_model="Qwen/Qwen3-8B").result()
        training = service.create_lora_training_client(base_model=state.name, rank=4).result()
        datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([1, 2]),
                                   loss_fn_inputs={"target_tokens": [2, 3]})  # ppo needs logprobs and advantages
        with pytest.raises(Exception, match="lacks \\['logprobs', 'advantages'\\]"):
            training.forward_backward([datum], "ppo").result()


def test_sample_options_the_server_does_not_serve_are_refused_by_name(server):
    """Top-k log-probs and the other sampling extras are refused, naming the option, not answered
    without them."""
    state, url = server
    with tinker.ServiceClient(base_url=url) as service:
        sampler = service.create_sampling_client(base_model=state.name)
        prompt, params = tinker.types.ModelInput.from_ints([1, 2, 3]), tinker.types.SamplingParams(max_tokens=2)
        for option in ({"topk_sample_logprobs": 2}, {"topk_prompt_logprobs": 2, "include_prompt_logprobs": True},
                       {"prompt_alt_tokens_k": 2, "include_prompt_logprobs": True}):
            name = next(k for k in option if k != "include_prompt_logprobs")
            with pytest.raises(Exception, match=f"sample options .*'{name}'.* are not served"):
                sampler.sample(prompt, 1, params, **option).result()
        assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 2  # the plain call works


def test_both_clients_load_the_tokenizer_offline_under_the_default_name(server, bpe_tokenizer):
    state, url = server
    assert state.name == str(data_path("tokenizers", "gsm8k-bpe4k").resolve())  # no --name: the tokenizer's folder
    with tinker.ServiceClient(base_url=url) as service:
        training = service.create_lora_training_client(base_model=state.name, rank=4).result()
        clients = {"training": training, "its sampler": training.save_weights_and_get_sampling_client().result(),
                   "a base-model sampler": service.create_sampling_client(base_model=state.name).result()}
        for what, client in clients.items():
            assert client.get_tokenizer().encode("12 + 3") == bpe_tokenizer.encode("12 + 3"), what


def test_a_folder_is_named_so_that_the_sdk_loads_its_tokenizer(bpe_tokenizer, monkeypatch):
    import shutil
    import tempfile

    import huggingface_hub.constants
    from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info

    from rltrainer.own_loop.service import sdk_tokenizer_name

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    folder = Path(tempfile.mkdtemp(dir="/tmp")).resolve()  # /tmp/tmpXXXX: the SDK reads two '/' as org/model/variant
    try:
        bpe_tokenizer.save_pretrained(folder)
        (folder / "a:b").mkdir()
        if str(folder).count("/") == 2:
            with pytest.raises(Exception):
                _load_tokenizer_from_model_info(str(folder))  # as it is, the SDK loads '/tmp'
        name = sdk_tokenizer_name(folder)
        assert len(_load_tokenizer_from_model_info(name)) == len(bpe_tokenizer)
        assert sdk_tokenizer_name(folder / "a:b") is None  # the SDK cuts a name at ':'
        assert sdk_tokenizer_name("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # a hub id is its own name
    finally:
        shutil.rmtree(folder)


def test_rltrainer_serve_starts_a_server_the_sdk_trains_through(bpe_tokenizer, tiny_config, tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "tiny"
    AutoModelForCausalLM.from_config(tiny_config).save_pretrained(model_dir)
    bpe_tokenizer.save_pretrained(model_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rltrainer", "serve", "--model", str(model_dir), "--port", "0"],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"Serving {model_dir.resolve()} on http://127.0.0.1:"), line  # the folder's name
        url = line.split(" on ")[1].split(" ")[0]
        monkeypatch.setenv("TINKER_API_KEY", "tml-local")
        monkeypatch.setenv("TINKER_TELEMETRY", "0")
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with tinker.ServiceClient(base_url=url) as service:
            training = service.create_lora_training_client(base_model=str(model_dir), rank=4).result()
            datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(SEQ[:-1]),
                                       loss_fn_inputs={"target_tokens": SEQ[1:]})
            out = training.forward([datum], "cross_entropy").result()
            assert out.metrics["loss:sum"] > 0 and len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(SEQ) - 1
            sampler = training.save_weights_and_get_sampling_client().result()
            served = AutoTokenizer.from_pretrained(model_dir)  # the server's (a Qwen2Tokenizer: config.json says qwen2)
            for client in (training, sampler):  # both load the folder offline, with no --name or --tokenizer
                assert client.get_tokenizer().encode("12 + 3") == served.encode("12 + 3")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sessions_list_their_training_runs_and_samplers(server):
    from tinker.types import SessionSearchRequest

    state, url = server
    rest = tinker.RestClient(base_url=url)
    with tinker.ServiceClient({"task": "addition"}, display_name="Nightly add run", base_url=url) as first:
        training = first.create_lora_training_client(base_model=state.name, rank=4).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        first_id = first.holder.get_session_id()
        got = rest.get_session(first_id).result()
        assert (got.training_run_ids, got.sampler_ids) == ([training.model_id], [sampler._sampling_session_id])
        assert (got.user_metadata, got.display_name) == ({"task": "addition"}, "Nightly add run")
        with tinker.ServiceClient(base_url=url) as second:
            second_id = second.holder.get_session_id()
            assert rest.get_session(second_id).result().training_run_ids == []
            assert rest.list_sessions().result().sessions == [second_id, first_id]  # newest first
            assert rest.list_sessions(limit=1, offset=1).result().sessions == [first_id]
            found = rest.search_sessions(SessionSearchRequest(display_name="add NIGHTLY")).result()
            assert [s.session_id for s in found.sessions] == [first_id] and found.next_cursor is None
            assert found.sessions[0].status.type == "active" and found.sessions[0].owner == "local"
            page = rest.search_sessions(SessionSearchRequest(limit=1)).result()
            assert [s.session_id for s in page.sessions] == [second_id]
            page = rest.search_sessions(SessionSearchRequest(limit=1, cursor=page.next_cursor)).result()
            assert [s.session_id for s in page.sessions] == [first_id] and page.next_cursor is None
            assert rest.search_sessions(SessionSearchRequest(user_metadata={"task": "other"})).result().sessions == []
    done = rest.search_sessions(SessionSearchRequest(session_id=first_id)).result().sessions
    assert [(s.status.type, s.status.reason.type) for s in done] == [("client_finished", "success")]
    with pytest.raises(tinker.NotFoundError, match="no session 'local-none'"):
        rest.get_session("local-none").result()


def test_an_expired_checkpoint_is_deleted_and_no_longer_listed_or_loadable(server):
    import time

    state, url = server
    rest = tinker.RestClient(base_url=url)
    with tinker.ServiceClient(base_url=url) as service:
        training = service.create_lora_training_client(base_model=state.name, rank=4).result()
        with pytest.raises(Exception, match="ttl_seconds must be a whole number of seconds from 1"):
            training.save_state("never", ttl_seconds=0).result()
        short = training.save_state("short", ttl_seconds=2).result().path
        sampler = training.save_weights_for_sampler("short", ttl_seconds=2).result().path
        kept = training.save_state("kept").result().path
        rest.set_checkpoint_ttl_from_tinker_path(kept, 3600).result()
        listed = {c.tinker_path: c.expires_at for c in rest.list_checkpoints(training.model_id).result().checkpoints}
        assert set(listed) == {short, sampler, kept} and all(listed.values())
        folder = Path(state.find(short)[1].location)
        assert folder.is_dir()

        time.sleep(max(listed[short], listed[sampler]).timestamp() - time.time() + 0.1)
        assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [kept]
        assert not folder.exists()  # deleted, not only forgotten
        with pytest.raises(Exception, match="no state .*short.* it expired at .* \\(its ttl_seconds\\) and was deleted"):
            training.load_state(short).result()
        with pytest.raises(Exception, match="no sampler weights .*short.* it expired at"):
            service.create_sampling_client(model_path=sampler).result()

        rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()  # None: never expires
        assert [c.expires_at for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [None]
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be"):
            rest.set_checkpoint_ttl_from_tinker_path(kept, -5).result()
        training.load_state(kept).result()


def test_gspo_over_the_server_is_the_same_loss_as_in_process(server, bpe_tokenizer, tiny_config, tmp_path):
    state, url = server
    local = TrainingClient(tiny_config, bpe_tokenizer, rank=8, root=tmp_path / "local", device="cpu")
    lp = local.forward([Datum(SEQ[:-1], {"target_tokens": torch.tensor(SEQ[1:])})]).result().loss_fn_outputs[0]["logprobs"]
    d = {**rl_datum(SEQ), "logprobs": (lp - 0.15).tolist(), "sequence_ratio_mask": [0.0] + [1.0] * (len(SEQ) - 2)}
    names = ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}  # s = e^0.15 = 1.16: clipped at 1.1, not at 1.2
    with tinker.ServiceClient(base_url=url) as service:
        training = service.create_lora_training_client(base_model=state.name, rank=8).result()
        datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(d["model_input"]),
                                   loss_fn_inputs={k: d[k] for k in names})
        out = training.forward_backward([datum], "gspo", config).result()
    local_datum = Datum(d["model_input"], {k: torch.tensor(d[k]) for k in names})
    same = local.forward_backward([local_datum], "gspo", config).result()
    assert out.metrics["loss:sum"] == pytest.approx(same.metrics["loss:sum"], rel=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(-1.1 * (len(SEQ) - 2), rel=1e-5)  # every advantage 1, clipped
    default = local.forward([local_datum], "gspo").result().metrics["loss:sum"]
    assert default == pytest.approx(-math.exp(0.15) * (len(SEQ) - 2), rel=1e-4)  # not clipped at 1.2


def test_a_finished_sessions_heartbeat_is_answered_gone(server):
    import json
    import urllib.error
    import urllib.request

    _, url = server

    def heartbeat(session_id: str) -> int:
        request = urllib.request.Request(f"{url}/api/v1/session_heartbeat", method="POST",
                                         data=json.dumps({"session_id": session_id}).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request, timeout=10).status
        except urllib.error.HTTPError as e:
            return e.code

    with tinker.ServiceClient(base_url=url) as service:
        session_id = service.holder.get_session_id()
        assert heartbeat(session_id) == 200
    assert heartbeat(session_id) == 410  # the SDK's heartbeat loops stop on it (a sampling client's copies too)
    assert heartbeat("local-none") == 410

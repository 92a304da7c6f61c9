"""The vLLM and SGLang adapters' translation code, on CPU, with outputs shaped like the libraries'
(their classes and fields are checked against the real sources in test_api_surface.py)."""

from types import SimpleNamespace

import pytest
import torch

from rltrainer.rollout import ENGINES, SamplingParams
from rltrainer.rollout.sglang import SGLangEngine, generation_from_sglang, sglang_requests
from rltrainer.rollout.vllm import generation_from_outputs


def completion(index, tokens, logps, reason):
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logps)]
    return SimpleNamespace(index=index, token_ids=tokens, logprobs=steps, text=f"c{index}", finish_reason=reason)


def test_vllm_outputs_become_a_generation():
    outputs = [SimpleNamespace(outputs=[completion(1, [7, 8], [-0.5, -0.25], "length"),
                                        completion(0, [5, 6, 2], [-1.0, -2.0, -3.0], "stop")]),
               SimpleNamespace(outputs=[completion(0, [9], [-0.1], "stop"), completion(1, [4, 4], [-0.3, -0.4], "length")])]
    decoder = SimpleNamespace(batch_decode=lambda rows, skip_special_tokens: [f"c{len(r)}" for r in rows])
    gen = generation_from_outputs(outputs, pad_token_id=0, tokenizer=decoder)  # texts: the trainer's tokenizer's
    assert gen.response_ids.tolist() == [[5, 6, 2], [7, 8, 0], [9, 0, 0], [4, 4, 0]]  # samples in index order
    assert gen.response_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]]
    torch.testing.assert_close(gen.log_probs[1], torch.tensor([-0.5, -0.25, 0.0]))
    assert gen.finish_reason == ["stop", "length", "stop", "length"] and gen.text == ["c3", "c2", "c1", "c2"]


def test_sglang_requests_and_outputs():
    ids, params = sglang_requests([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=5, top_k=0, seed=10), [2])
    assert ids == [[1, 2], [1, 2], [3], [3]]
    assert [p["sampling_seed"] for p in params] == [10, 11, 12, 13]  # one seed per sample
    assert params[0]["top_k"] == -1 and params[0]["stop_token_ids"] == [2] and not params[0]["ignore_eos"]
    assert sglang_requests([[3]], SamplingParams(), [])[1][0]["ignore_eos"]  # no stop tokens: run to the limit
    outputs = [{"output_ids": [4, 2], "text": "a", "meta_info": {"output_token_logprobs": [(-0.5, 4, None), (-1.5, 2, None)],
                                                                   "finish_reason": {"type": "stop", "matched": 2}}},
               {"output_ids": [6], "text": "b", "meta_info": {"output_token_logprobs": [(-0.7, 6, None)],
                                                              "finish_reason": {"type": "length", "length": 1}}}]
    gen = generation_from_sglang(outputs, pad_token_id=0)
    assert gen.response_ids.tolist() == [[4, 2], [6, 0]] and gen.finish_reason == ["stop", "length"]
    torch.testing.assert_close(gen.log_probs, torch.tensor([[-0.5, -1.5], [-0.7, 0.0]]))


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_gpu_engines_are_registered_and_say_what_they_need(name, tiny_config, bpe_tokenizer):
    engine = ENGINES.build(name)
    assert engine.dtype == torch.bfloat16
    with pytest.raises((ImportError, ValueError), match=f"{name}|CUDA"):
        engine.setup(tiny_config, bpe_tokenizer, device="cpu")


class RecordingSGLang:
    """Stands in for ``sglang.Engine``: records the weight-update calls, answers like SGLang."""

    def __init__(self, refuse: str | None = None):
        self.calls, self.refuse = [], refuse

    def __getattr__(self, call):
        def record(*args, **kwargs):
            self.calls.append(call)
            return (call != self.refuse, f"{call} refused" if call == self.refuse else "Success")
        return record


def test_sglang_colocated_update_is_one_checked_session():
    """SGLang 0.5.23 refuses weight updates outside begin/end_weight_update, and reports failures
    as (False, message): the adapter opens one session per update and raises on a refusal."""
    from rltrainer.rollout.sglang import SGLangEngine

    engine = SGLangEngine(bucket_bytes=64)
    engine.engine = RecordingSGLang()
    weights = [(f"w{i}", torch.zeros(8)) for i in range(3)]  # 32 bytes each: 2 buckets of 64
    assert engine.update_weights(weights) == {"tensors": 3, "bytes": 96}
    assert engine.engine.calls == ["begin_weight_update", "update_weights_from_tensor", "update_weights_from_tensor",
                                   "end_weight_update", "flush_cache"]
    engine.engine = RecordingSGLang(refuse="update_weights_from_tensor")
    with pytest.raises(RuntimeError, match=r"update_weights_from_tensor\(\) failed: .* refused"):
        engine.update_weights(weights)
    assert engine.engine.calls[-1] == "end_weight_update"  # the failed update's session is closed
    engine.engine = RecordingSGLang()
    engine.update_weights(weights)  # and the next one opens its own
    assert engine.engine.calls[0] == "begin_weight_update"


def test_no_sglang_call_aborts_the_requests_in_flight():
    """SGLang 0.5.23's ``update_weight_version`` aborts every request in flight unless given
    ``abort_all_requests=False`` (``UpdateWeightVersionReqInput.abort_all_requests = True``); its
    weight-update requests default to False. Any call of it, or any ``abort_all_requests`` passed,
    in rltrainer must say False (today there is none: rltrainer keeps the versions itself)."""
    import ast
    import pathlib

    import rltrainer

    offending = []
    for path in pathlib.Path(rltrainer.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            kept = {k.arg: k.value for k in node.keywords}
            abort = kept.get("abort_all_requests")
            says_false = isinstance(abort, ast.Constant) and abort.value is False
            if (name in ("update_weight_version", "UpdateWeightVersionReqInput") or abort is not None) and not says_false:
                offending.append(f"{path.name}:{node.lineno}")
    assert not offending, f"calls that may abort SGLang's requests in flight: {offending}"


# -- what the libraries do, as read in their wheels (sglang 0.5.23, vllm 0.33.0) ---------------------
EOS = 2


def sglang_finishes(params: dict, token: int, eos_ids: set[int]) -> bool:
    """``Req._check_token_based_finish`` (sglang/srt/managers/schedule_batch.py:1856-1878):
    ``ignore_eos`` returns False before ``stop_token_ids`` is consulted; without it a token
    finishes the request if it is a stop token or one of the model's / tokenizer's EOS ids."""
    if params["ignore_eos"]:
        return False
    return token in (params["stop_token_ids"] or ()) or token in eos_ids


class ScriptedSGLang:
    """``sglang.Engine.generate`` on a scripted token stream (the same for every request), finishing
    as SGLang does; records every call. Seeds are read only with deterministic inference
    (sglang/srt/sampling/sampling_batch_info.py:157-172), which this fake does not model."""

    def __init__(self, script, eos_ids=frozenset({EOS})):
        self.script, self.eos_ids, self.calls = list(script), set(eos_ids), []

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append(("generate", None))
        outputs = []
        for params in sampling_params:
            out, finish = [], {"type": "length", "length": params["max_new_tokens"]}
            for token in self.script[:params["max_new_tokens"]]:
                out.append(token)
                if sglang_finishes(params, token, self.eos_ids):
                    finish = {"type": "stop", "matched": token}
                    break
            outputs.append({"output_ids": out, "text": "", "meta_info": {
                "output_token_logprobs": [(-1.0, t, None) for t in out], "finish_reason": finish}})
        return outputs


def sglang_engine(fake, **kwargs):
    from rltrainer.rollout.sglang import SGLangEngine

    engine = SGLangEngine(**kwargs)
    engine.engine, engine.tokenizer = fake, SimpleNamespace(eos_token_id=EOS, pad_token_id=0)
    return engine


def test_sglang_stops_at_eos_by_default_and_runs_on_with_no_stop_tokens():
    """Issue 12.1: ``stop_token_ids=[eos]`` with ``ignore_eos=True`` never stopped on SGLang."""
    engine = sglang_engine(ScriptedSGLang([5, 6, EOS, 7, 8, 9]))
    gen = engine.generate([[1]], SamplingParams(max_new_tokens=6))
    assert gen.response_ids.tolist() == [[5, 6, EOS]] and gen.finish_reason == ["stop"]
    free = engine.generate([[1]], SamplingParams(max_new_tokens=6, stop_token_ids=[]))
    assert free.response_ids.tolist() == [[5, 6, EOS, 7, 8, 9]] and free.finish_reason == ["length"]
    own = engine.generate([[1]], SamplingParams(max_new_tokens=6, stop_token_ids=[6, EOS]))
    assert own.response_ids.tolist() == [[5, 6]] and own.finish_reason == ["stop"]


def test_sglang_says_once_that_it_also_stops_at_eos(caplog):
    engine = sglang_engine(ScriptedSGLang([5, EOS, 7]))
    with caplog.at_level("WARNING", logger="rltrainer.rollout.sglang"):
        gen = engine.generate([[1]], SamplingParams(max_new_tokens=3, stop_token_ids=[7]))
        engine.generate([[1]], SamplingParams(max_new_tokens=3, stop_token_ids=[7]))
    assert gen.response_ids.tolist() == [[5, EOS]]  # what SGLang does; the warning says so
    assert [r.message.count("stops at EOS [2] as well") for r in caplog.records] == [1]


def test_sglang_warns_once_that_seeds_need_deterministic_inference(caplog):
    """Issue 12.7: without ``enable_deterministic_inference`` SGLang samples with no seed
    (sampling_batch_info.py:157-172 builds ``sampling_seed`` only when it is on)."""
    seeded = SamplingParams(max_new_tokens=2, seed=3)
    with caplog.at_level("WARNING", logger="rltrainer.rollout.sglang"):
        engine = sglang_engine(ScriptedSGLang([5, 6]))
        engine.generate([[1]], seeded)
        engine.generate([[1]], seeded)
        sglang_engine(ScriptedSGLang([5, 6]), engine_kwargs={"enable_deterministic_inference": True}).generate(
            [[1]], seeded)
        sglang_engine(ScriptedSGLang([5, 6])).generate([[1]], SamplingParams(max_new_tokens=2, seed=3,
                                                                             temperature=0.0))  # greedy: no seed used
    warnings = [r.message for r in caplog.records if "enable_deterministic_inference" in r.message]
    assert len(warnings) == 1 and "seed=3" in warnings[0]


def test_sglang_tensor_parallel_needs_its_gpus_visible(monkeypatch, tiny_config, bpe_tokenizer):
    """Issue 12.4: SGLang starts TP rank k on GPU ``base_gpu_id + k`` (sglang/srt/entrypoints/engine.py:935-939);
    a Ray worker sees one GPU, so tp_size=2 there is refused before SGLang starts."""
    from rltrainer.rollout.sglang import SGLangEngine

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tp_size=2\) starts its schedulers on GPUs 0..1 of this process, which "
                                         r"sees 1 .*tp_size=1 with more replicas"):
        SGLangEngine(tp_size=2).setup(tiny_config, bpe_tokenizer, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="GPUs 1..2 of this process, which sees 2"):
        SGLangEngine(tp_size=2).setup(tiny_config, bpe_tokenizer, device="cuda:1")
    with pytest.raises(ValueError, match=r"tp_size must be an int >= 1.*got 0"):
        SGLangEngine(tp_size=0)


class FakeVLLMSamplingParams:
    """vLLM's ``SamplingParams`` as far as the adapter relies on it: greedy with ``n > 1`` raises
    (vllm/sampling_params.py:615-620 and 769-773)."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
        if self.temperature < 1e-5 and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")


class FakeLLM:
    """``vllm.LLM.generate``: one params per prompt or one for all (vllm/entrypoints/common/offline.py:253-267);
    child ``j`` of a seeded request samples with ``seed + j`` (vllm/v1/engine/parallel_sampling.py:69-81).
    A sample's tokens are a function of its prompt and seed (random without one; argmax-like when greedy)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling_params, use_tqdm):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and params ({len(params)}) must be the same.")
        outputs = []
        for prompt, p in zip(prompts, params):
            completions = []
            for j in range(p.n):
                if p.temperature == 0:
                    tokens = [sum(prompt["prompt_token_ids"]) % 50 + 3] * 3
                else:
                    gen = torch.Generator().manual_seed(p.seed + j) if p.seed is not None else None
                    tokens = torch.randint(3, 1000, (3,), generator=gen).tolist()
                completions.append(completion(j, tokens, [-1.0] * 3, "length"))
            outputs.append(SimpleNamespace(outputs=completions))
        return outputs

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


@pytest.fixture
def vllm_engine(monkeypatch):
    import sys

    from rltrainer.rollout.vllm import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=FakeVLLMSamplingParams))
    engine = VLLMEngine()
    engine.llm = FakeLLM()
    engine.tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=0, batch_decode=lambda rows, **_: [""] * len(rows))
    return engine


def test_vllm_greedy_with_several_samples_is_one_sample_repeated(vllm_engine):
    """Issue 12.6: vLLM refuses greedy with n > 1; validation asks for exactly that."""
    gen = vllm_engine.generate([[1, 2], [7]], SamplingParams(n=3, max_new_tokens=3, temperature=0.0))
    assert gen.response_ids.tolist() == [[6, 6, 6]] * 3 + [[10, 10, 10]] * 3
    assert gen.response_mask.shape == (6, 3) and len(gen.text) == len(gen.finish_reason) == 6
    assert gen.metrics["gen_tokens"] == 18.0


def test_vllm_seeds_differ_per_prompt_and_reproduce(vllm_engine):
    """Issue 12.7: one shared SamplingParams gave every prompt the same seeds, so two equal prompts
    in a batch got equal samples; each prompt now gets ``seed + i * n`` (vLLM adds ``j``)."""
    sampling = SamplingParams(n=2, max_new_tokens=3, seed=5)
    gen = vllm_engine.generate([[1, 2], [1, 2]], sampling)
    rows = [tuple(r) for r in gen.response_ids.tolist()]
    assert len(set(rows)) == 4  # seeds 5, 6 | 7, 8
    assert torch.equal(vllm_engine.generate([[1, 2], [1, 2]], sampling).response_ids, gen.response_ids)
    one = vllm_engine.generate([[1, 2]], SamplingParams(n=4, max_new_tokens=3, seed=5))
    assert [tuple(r) for r in one.response_ids.tolist()] == rows  # seed + i * n + j, as one request of 4


def test_vllm_generate_refuses_a_temperature_vllm_would_raise(vllm_engine):
    """Issue 30.11: vLLM raises 0 < T < 0.01 to 0.01 with a warning (vllm/sampling_params.py), so the
    samples and log-probs would not be at the requested temperature: refused before vLLM sees it."""
    with pytest.raises(ValueError, match=r"temperature=0.005; vLLM samples with 0 \(greedy\) or a temperature in"):
        vllm_engine.generate([[1]], SamplingParams(temperature=0.005, max_new_tokens=3))
    assert vllm_engine.generate([[1]], SamplingParams(temperature=0.01, max_new_tokens=3)).response_ids.shape == (1, 3)


def test_sglang_and_vllm_seed_each_sample_alike():
    _, params = sglang_requests([[1], [2]], SamplingParams(n=2, seed=5), [EOS])
    assert [p["sampling_seed"] for p in params] == [5, 6, 7, 8]


# -- issue 30: defects found by reading the wheels ----------------------------------------------------
def llama_config(vocab_size):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("family, expected", [("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
                                              ("llama", "LlamaForCausalLM")])
def test_engine_files_name_the_architecture_of_a_config_built_policy(family, expected, bpe_tokenizer):
    """Issue 30.8: a policy built from a config has ``architectures=None``; SGLang indexes
    ``hf_config.architectures[0]`` (sglang/srt/configs/model_config.py) and vLLM resolves the
    model class from the list, so the engine's config.json must name it."""
    import json

    from rltrainer.models import build_causal_lm
    from rltrainer.rollout.engine import gpu_engine_files
    from rltrainer.testing import tiny_qwen2_config, tiny_qwen3_config

    make = {"qwen2": lambda v: tiny_qwen2_config(v, hidden_size=32, num_layers=1),
            "qwen3": lambda v: tiny_qwen3_config(v, hidden_size=32, num_layers=1), "llama": llama_config}[family]
    config = build_causal_lm(make(len(bpe_tokenizer)), seed=0).config  # what the strategy hands the engine
    assert not config.architectures
    folder = gpu_engine_files("sglang", "cuda:0", config, bpe_tokenizer)
    try:
        with open(f"{folder.name}/config.json") as f:
            written = json.load(f)
    finally:
        folder.cleanup()
    assert written["architectures"] == [expected] and written["model_type"] == family
    assert not config.architectures  # the caller's config is left as it was


def test_engine_files_keep_given_architectures_and_refuse_unknown_ones(bpe_tokenizer):
    import json

    from transformers import PretrainedConfig

    from rltrainer.rollout.engine import gpu_engine_files
    from rltrainer.testing import tiny_qwen2_config

    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=1, architectures=["MyQwen2"])
    folder = gpu_engine_files("vllm", None, config, bpe_tokenizer)
    with open(f"{folder.name}/config.json") as f:
        assert json.load(f)["architectures"] == ["MyQwen2"]
    folder.cleanup()
    with pytest.raises(ValueError, match=r"rollout='sglang' .* model_type='' has no transformers causal LM class.*"
                                         r"config.architectures = "):
        gpu_engine_files("sglang", None, PretrainedConfig(), bpe_tokenizer)


def test_sglang_output_with_no_tokens_is_an_empty_row():
    """Issue 30.12: an aborted request has no output tokens but one log-prob entry (SGLang sends
    ``max(len(output_ids), 1)``: scheduler_components/output_streamer.py); it was a shape mismatch."""
    aborted = {"output_ids": [], "text": "", "meta_info": {"output_token_logprobs": [(-0.3, 7, None)],
                                                           "finish_reason": {"type": "abort", "message": "aborted"}}}
    done = {"output_ids": [4, 2], "text": "a",
            "meta_info": {"output_token_logprobs": [(-0.5, 4, None), (-1.5, 2, None)],
                          "finish_reason": {"type": "stop", "matched": 2}}}
    gen = generation_from_sglang([done, aborted], pad_token_id=0)
    assert gen.response_ids.tolist() == [[4, 2], [0, 0]] and gen.response_mask.tolist() == [[1, 1], [0, 0]]
    torch.testing.assert_close(gen.log_probs, torch.tensor([[-0.5, -1.5], [0.0, 0.0]]))
    only = generation_from_sglang([aborted], pad_token_id=0)  # every request aborted: one padding column
    assert only.response_mask.tolist() == [[0]] and only.log_probs.tolist() == [[0.0]]


class LoRASGLang(ScriptedSGLang):
    """``sglang.Engine`` with LoRA: weight-update calls answer ``(success, message)``; the LoRA calls
    answer a ``LoRAUpdateOutput`` (``success``, ``error_message``, ``loaded_adapters``: no
    ``message``; sglang/srt/managers/io_struct.py), as ``TokenizerManager.load_lora_adapter`` does
    when it refuses (tokenizer_control_mixin.py)."""

    def __init__(self, load_error: str | None = None, unload_error: str | None = None):
        super().__init__([5, EOS])
        self.errors = {"load_lora_adapter": load_error, "unload_lora_adapter": unload_error}

    def generate(self, input_ids, sampling_params, return_logprob, lora_path=None):
        return super().generate(input_ids, sampling_params, return_logprob)

    def _lora(self, call, name):
        self.calls.append((call, name))
        error = self.errors[call]
        return SimpleNamespace(success=error is None, error_message=error, loaded_adapters=None)

    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        return self._lora("load_lora_adapter", lora_name)

    def unload_lora_adapter(self, lora_name):
        return self._lora("unload_lora_adapter", lora_name)

    def __getattr__(self, call):  # begin/end_weight_update, update_weights_from_tensor, flush_cache
        return lambda *args, **kwargs: (True, "Success")


def lora_sglang(fake):
    import peft

    engine = sglang_engine(fake, enable_lora=True, max_lora_rank=8)
    engine.enable_adapters(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    return engine


ADAPTER = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(4, 8))]


def test_sglang_lora_failures_say_why():
    """Issue 30.13a: the LoRA calls' text is in ``error_message``; the error used to end in an empty message."""
    message = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
    refused = lora_sglang(LoRASGLang(load_error=message))
    refused.update_weights(ADAPTER)
    with pytest.raises(RuntimeError, match=r"load_lora_adapter\(\) failed: LoRA is not enabled\. Please set"):
        refused.generate([[1]], SamplingParams(max_new_tokens=2))
    refused.teardown()
    in_use = lora_sglang(LoRASGLang(unload_error="LoRA adapter 'rltrainer-policy-v1' is in use"))
    in_use.update_weights(ADAPTER)
    in_use.generate([[1]], SamplingParams(max_new_tokens=2))  # loads v1
    in_use.update_weights(ADAPTER)  # v2 replaces it: unloading v1 fails
    with pytest.raises(RuntimeError, match=r"unload_lora_adapter\(\) failed: LoRA adapter 'rltrainer-policy-v1' "
                                           r"is in use"):
        in_use.generate([[1]], SamplingParams(max_new_tokens=2))
    in_use.teardown()
    from rltrainer.rollout.sglang import _checked

    with pytest.raises(RuntimeError, match=r"flush_cache\(\) failed: \(no message\)"):
        _checked(SimpleNamespace(success=False), "flush_cache")


def test_sglang_lora_refuses_the_broadcast_transport():
    """Issue 30.13b: split placement's broadcast loads SGLang's base weights only, so a LoRA engine is
    refused when the strategy resolves the transport, before any replica starts (it was refused at the
    first sync, after the replicas had started and joined the group)."""
    from rltrainer.rollout.sglang import SGLangEngine

    engine = SGLangEngine(enable_lora=True)
    with pytest.raises(ValueError, match=r"enable_lora=True\) .* broadcast .* Use Rollout\(placement='colocated'\), "
                                         r"transport='shared_memory' or 'object_store', or enable_lora=False"):
        engine.check_split_transport("broadcast", adapter=True)
    engine.check_split_transport("shared_memory", adapter=True)  # these call update_weights, which splits the adapter
    engine.check_split_transport("object_store", adapter=True)
    engine.check_split_transport("broadcast", adapter=False)  # a full policy: merged weights are broadcast
    ENGINES.build("hf").check_split_transport("broadcast", adapter=True)  # the default accepts every transport
    engine = lora_sglang(LoRASGLang())
    with pytest.raises(ValueError, match="broadcast"):  # and the engine's own hooks refuse as a backstop
        engine.receive_weights([("w", "float32", (2,))], last=True)
    engine.teardown()


def test_sglang_refuses_to_record_routes_before_it_starts(tiny_config, bpe_tokenizer):
    """Routing replay asks the engine for routes (a MoE policy); SGLang's adapter does not record
    them yet, and says so at setup, with what to use instead."""
    engine = SGLangEngine()
    engine.return_routed_experts = True
    with pytest.raises(ValueError, match=r"does not record routed experts.*routing_replay='off'"):
        engine.setup(tiny_config, bpe_tokenizer)

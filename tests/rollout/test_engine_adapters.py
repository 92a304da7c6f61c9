"""The vLLM and SGLang adapters' translation code, on CPU, with outputs shaped like the libraries'
(their classes and fields are checked against the real sources in test_api_surface.py)."""

from types import SimpleNamespace

import pytest
import torch

from rltrainer.rollout import ENGINES, SamplingParams
from rltrainer.rollout.sglang import generation_from_sglang, sglang_requests
from rltrainer.rollout.vllm import generation_from_outputs


def completion(index, tokens, logps, reason):
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logps)]
    return SimpleNamespace(index=index, token_ids=tokens, logprobs=steps, text=f"c{index}", finish_reason=reason)


def test_vllm_outputs_become_a_generation():
    outputs = [SimpleNamespace(outputs=[completion(1, [7, 8], [-0.5, -0.25], "length"),
                                        completion(0, [5, 6, 2], [-1.0, -2.0, -3.0], "stop")]),
               SimpleNamespace(outputs=[completion(0, [9], [-0.1], "stop"), completion(1, [4, 4], [-0.3, -0.4], "length")])]
    gen = generation_from_outputs(outputs, pad_token_id=0, tokenizer=None)
    assert gen.response_ids.tolist() == [[5, 6, 2], [7, 8, 0], [9, 0, 0], [4, 4, 0]]  # samples in index order
    assert gen.response_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]]
    torch.testing.assert_close(gen.log_probs[1], torch.tensor([-0.5, -0.25, 0.0]))
    assert gen.finish_reason == ["stop", "length", "stop", "length"] and gen.text == ["c0", "c1", "c0", "c1"]


def test_sglang_requests_and_outputs():
    ids, params = sglang_requests([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=5, top_k=0, seed=10), [2])
    assert ids == [[1, 2], [1, 2], [3], [3]]
    assert [p["sampling_seed"] for p in params] == [10, 11, 12, 13]  # one seed per sample
    assert params[0]["top_k"] == -1 and params[0]["stop_token_ids"] == [2] and params[0]["ignore_eos"]
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

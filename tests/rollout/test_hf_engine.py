"""HFEngine on CPU with a tiny random Qwen2 model and the gsm8k-bpe4k tokenizer."""

from __future__ import annotations

import copy

import pytest
import torch

from rltrainer.data.batch import RolloutBatch
from rltrainer.models import response_log_probs
from rltrainer.module import generate_rollouts
from rltrainer.rollout.engine import Generation, SamplingParams, build_engine
from rltrainer.rollout.hf import HFEngine
from rltrainer.testing import DATA_DIR

TOKENIZER_DIR = DATA_DIR / "tokenizers" / "gsm8k-bpe4k"

TEXTS = ["Natalia sold clips to 48 of her friends.", "2 + 2 =", "Q",
         "What is the sum of 17 and 25? Think step by step.", "Weng earns $12 an hour"]
EVERY_20TH = list(range(0, 4096, 20))  # ~5 % of the vocabulary: random models stop at varied lengths


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def config(tokenizer):
    from transformers import Qwen2Config

    # initializer_range 0.3 (not 0.02) so greedy decoding does not just repeat the last prompt token
    return Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True, initializer_range=0.3)


@pytest.fixture(scope="module")
def policy(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


def make_engine(config, tokenizer, policy, **kwargs) -> HFEngine:
    engine = HFEngine(**kwargs)
    engine.setup(config, tokenizer)
    engine.update_weights(policy.named_parameters())
    return engine


@pytest.fixture(scope="module")
def engine(config, tokenizer, policy) -> HFEngine:
    return make_engine(config, tokenizer, policy)


def greedy(max_new_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kwargs)


def left_padded(prompts: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    P = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def responses(gen: Generation) -> list[list[int]]:
    return [row[row_mask.bool()].tolist() for row, row_mask in zip(gen.response_ids, gen.response_mask)]


# -- weights ---------------------------------------------------------------------------------------
def test_update_weights_gives_the_policys_logits_in_separate_memory(engine, policy, prompts, tokenizer):
    batch = left_padded(prompts, tokenizer.pad_token_id)
    with torch.no_grad():
        expected = policy(**batch, use_cache=False).logits
        got = engine.model(**batch, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert all(p.data_ptr() not in policy_ptrs for p in engine.model.parameters())
    assert not any(p.requires_grad for p in engine.model.parameters())


def test_bind_weights_shares_the_policys_storage_and_never_writes_into_it(config, tokenizer):
    """bind_weights: the engine's parameters become the given tensors (tied ones follow), a later
    in-place change of the policy shows in the engine at once, and update_weights afterwards
    gives the engine a copy of its own instead of writing into the policy."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    policy = AutoModelForCausalLM.from_config(config)
    engine = HFEngine()
    engine.setup(config, tokenizer)
    live = [(n, p.detach()) for n, p in policy.named_parameters()]
    stats = engine.bind_weights(live)
    assert stats == {"tensors": len(live), "bytes": 0, "shared": len(live)}
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert {p.data_ptr() for p in engine.model.parameters()} == policy_ptrs
    assert engine.model.lm_head.weight.data_ptr() == policy.model.embed_tokens.weight.data_ptr()  # tied
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        policy.model.norm.weight.mul_(2.0)  # an optimizer step, in place
        torch.testing.assert_close(engine.model(ids).logits, policy(ids).logits, rtol=0, atol=0)
    assert engine.bind_weights(live)["shared"] == len(live)  # already bound: nothing to do

    norm_before = policy.model.norm.weight.detach().clone()
    engine.update_weights([("model.norm.weight", torch.zeros_like(norm_before))])
    assert torch.equal(policy.model.norm.weight, norm_before)  # the policy is untouched
    assert engine.model.model.norm.weight.data_ptr() != policy.model.norm.weight.data_ptr()
    assert torch.equal(engine.model.model.norm.weight, torch.zeros_like(norm_before))


def test_bind_weights_copies_what_it_cannot_share(config, tokenizer, policy):
    """Another dtype, or share_weights=False: copied as update_weights does."""
    half = HFEngine(dtype="bf16")
    half.setup(config, tokenizer)
    named = [(n, p.detach()) for n, p in policy.named_parameters()]
    stats = half.bind_weights(named)
    assert stats["shared"] == 0 and stats["bytes"] == sum(p.numel() * 4 for _, p in named)
    assert not {p.data_ptr() for p in half.model.parameters()} & {p.data_ptr() for p in policy.parameters()}
    own = HFEngine(share_weights=False)
    own.setup(config, tokenizer)
    assert "shared" not in own.bind_weights(named) and own.shares_weights is False
    with pytest.raises(ValueError, match="share_weights must be True"):
        HFEngine(share_weights="yes")


def test_update_weights_changes_outputs_and_reports_stats(config, tokenizer, policy, prompts):
    engine = make_engine(config, tokenizer, policy)
    batch = left_padded(prompts, tokenizer.pad_token_id)
    before = engine.model(**batch).logits
    named = list(policy.named_parameters())
    buckets = [named[:10], named[10:]]
    torch.manual_seed(1)
    stats = engine.update_weights((n, p + 0.05 * torch.randn_like(p)) for bucket in buckets for n, p in bucket)
    assert stats == {"tensors": len(named), "bytes": sum(p.numel() * 4 for _, p in named)}
    assert not torch.allclose(engine.model(**batch).logits, before)

    embed = torch.zeros_like(policy.model.embed_tokens.weight)
    assert engine.update_weights([("lm_head.weight", embed)])["tensors"] == 1  # tied alias of embed_tokens
    assert torch.equal(engine.model.model.embed_tokens.weight, embed)
    with pytest.raises(KeyError, match="model.embed_tokens.weight"):
        engine.update_weights([("model.not_a_layer.weight", embed)])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.ones(3))])


def test_update_weights_casts_dtype(config, tokenizer, policy, prompts):
    engine = make_engine(config, tokenizer, policy, dtype="bf16")
    assert engine.model.model.norm.weight.dtype == torch.bfloat16
    gen = engine.generate(prompts[:2], greedy(4))
    assert gen.log_probs.dtype == torch.float32 and gen.response_ids.shape == (2, 4)


# -- generation ------------------------------------------------------------------------------------
def test_rollout_log_probs_match_the_trainers(engine, policy, prompts, tokenizer):
    sampling = SamplingParams(n=3, temperature=0.7, max_new_tokens=24, stop_token_ids=EVERY_20TH, seed=0)
    batch = RolloutBatch(non_tensors={"prompt_ids": prompts})
    rollouts = generate_rollouts(batch, engine, sampling, tokenizer.pad_token_id)
    lengths = rollouts["response_mask"].sum(1)
    assert len(set(lengths.tolist())) > 2, "want rows of varied lengths (compaction, padding)"
    with torch.no_grad():
        expected, _ = response_log_probs(policy, rollouts, temperature=0.7)
    mask = rollouts["response_mask"].bool()
    # cached decoding vs one forward: ~200 roundings deep of logits / 0.7 up to 15.5: 200 * 6e-8 * 15.5 = 1.9e-4
    torch.testing.assert_close(rollouts["rollout_log_probs"][mask], expected[mask], rtol=0, atol=2e-4)


def test_shapes_adjacent_samples_and_padding(engine, prompts, tokenizer):
    one = engine.generate(prompts, greedy(8))
    two = engine.generate(prompts, greedy(8, n=2))
    R, T = two.response_ids.shape
    assert (R, T) == (2 * len(prompts), 8)
    assert two.response_ids.dtype == two.response_mask.dtype == torch.long and two.log_probs.dtype == torch.float32
    assert len(two.text) == len(two.finish_reason) == R
    assert torch.equal(two.response_ids, one.response_ids.repeat_interleave(2, dim=0))  # row i*n+j: prompt i
    assert set(two.finish_reason) == {"length"} and (two.log_probs < 0).all()
    assert two.metrics["gen_tokens"] == R * T and two.metrics["tokens_per_s"] > 0
    assert two.text[0] == tokenizer.decode(two.response_ids[0].tolist(), skip_special_tokens=True)


def test_stops_at_a_stop_token_and_pads_after_it(engine, prompts, tokenizer):
    ref = engine.generate(prompts, greedy(8))
    stop = int(ref.response_ids[0, 2])
    gen = engine.generate(prompts, greedy(8, stop_token_ids=[stop]))
    lengths = []
    for i, tokens in enumerate(responses(ref)):
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        lengths.append(cut)
        assert responses(gen)[i] == tokens[:cut]
        assert gen.finish_reason[i] == ("stop" if stop in tokens else "length")
        assert (gen.response_ids[i, cut:] == tokenizer.pad_token_id).all()
        assert (gen.log_probs[i, cut:] == 0).all() and gen.response_mask[i, :cut].all()
    assert gen.response_ids.shape[1] == max(lengths)
    assert "stop" in gen.finish_reason and gen.response_mask.sum() == gen.metrics["gen_tokens"]


def test_default_stop_is_the_tokenizers_eos(config, tokenizer, policy, prompts):
    engine = make_engine(config, tokenizer, policy)
    stop = int(engine.generate(prompts[:1], greedy(4)).response_ids[0, 0])
    engine.tokenizer = copy.deepcopy(tokenizer)
    engine.tokenizer.eos_token = tokenizer.convert_ids_to_tokens(stop)
    gen = engine.generate(prompts[:1], greedy(4))
    assert gen.response_ids.tolist() == [[stop]] and gen.finish_reason == ["stop"]


def test_top_k_1_and_tiny_top_p_are_greedy(engine, prompts):
    expected = engine.generate(prompts, greedy(8)).response_ids
    for sampling in (SamplingParams(top_k=1, max_new_tokens=8, seed=3), SamplingParams(top_p=1e-6, max_new_tokens=8)):
        assert torch.equal(engine.generate(prompts, sampling).response_ids, expected)


def test_seed_reproduces_and_differs(engine, prompts):
    def sample(seed: int) -> Generation:
        return engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, top_p=0.9, top_k=50, seed=seed))

    a, b, c = sample(0), sample(0), sample(1)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.response_ids, c.response_ids)


@pytest.mark.parametrize("n, max_batch_size", [(1, 2), (2, 3)])
def test_chunks_give_the_same_results(config, tokenizer, policy, prompts, n, max_batch_size):
    sampling = greedy(10, n=n, stop_token_ids=EVERY_20TH)
    whole = make_engine(config, tokenizer, policy).generate(prompts, sampling)
    chunked = make_engine(config, tokenizer, policy, max_batch_size=max_batch_size).generate(prompts, sampling)
    assert torch.equal(chunked.response_ids, whole.response_ids)
    assert torch.equal(chunked.response_mask, whole.response_mask)
    assert chunked.finish_reason == whole.finish_reason
    # different batch shapes round differently: about 200 fp32 roundings deep (hidden 64 plus the
    # attention span), each up to u = 2**-24 of logits up to 11: 200 * 6e-8 * 11 = 1.3e-4
    torch.testing.assert_close(chunked.log_probs, whole.log_probs, rtol=0, atol=1.5e-4)


# -- lifecycle -------------------------------------------------------------------------------------
def test_registry_lifecycle_and_errors(config, tokenizer, policy, prompts):
    engine = build_engine("hf", max_batch_size=4)
    assert isinstance(engine, HFEngine) and engine.max_batch_size == 4
    with pytest.raises(RuntimeError, match="setup"):
        engine.generate(prompts, greedy())
    engine.setup(config, tokenizer)
    engine.update_weights(policy.named_parameters())
    with pytest.raises(ValueError, match="non-empty"):
        engine.generate([prompts[0], []], greedy())
    engine.sleep(1)
    engine.wake_up()
    engine.sleep(2)
    engine.wake_up()
    assert engine.generate(prompts[:1], greedy(2)).response_ids.shape == (1, 2)
    engine.teardown()
    assert engine.model is None
    with pytest.raises(ValueError, match="dtype"):
        HFEngine(dtype="float17")


@pytest.mark.parametrize("temperature, top_k, top_p, keep", [(0.5, 0, 1.0, 5), (1.0, 2, 1.0, 2), (1.0, 0, 0.7, 2)])
def test_sampling_follows_the_filtered_softmax(temperature, top_k, top_p, keep):
    from rltrainer.rollout.hf import _sample

    logits = torch.tensor([2.0, 1.5, 0.0, -1.0, -3.0]).repeat(40_000, 1)  # softmax: .53 .32 .07 .03 .00
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    u = torch.rand((len(logits), 1), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens, log_probs = _sample(logits, sampling, u)
    probs = torch.softmax(logits[0] / temperature, -1)
    expected = torch.zeros(5)
    expected[:keep] = probs[:keep] / probs[:keep].sum()
    assert (tokens < keep).all(), "a filtered-out token was sampled"
    torch.testing.assert_close(torch.bincount(tokens, minlength=5) / len(tokens), expected, rtol=0, atol=0.01)
    torch.testing.assert_close(log_probs, probs.log()[tokens])  # before filtering


@pytest.mark.parametrize("block", [2, 1024])
def test_two_level_inverse_cdf_picks_the_one_level_token(block, monkeypatch):
    """Unfiltered sampling finds the token in blocks (block sums, then one block's CDF): the token the
    one-level fp64 CDF gives for the same uniform, and log-probs of softmax(logits / T)."""
    import rltrainer.rollout.hf as hf

    monkeypatch.setattr(hf, "SAMPLE_BLOCK", block)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 5000, generator=g) * 3
    logits[:, 4321] += 12  # one likely token in a late block
    u = torch.rand((len(logits), 1), generator=g, dtype=torch.float64)
    tokens, log_probs = hf._sample(logits, SamplingParams(temperature=0.7), u)
    scaled = logits / 0.7
    cdf = torch.softmax(scaled, -1).cumsum(-1, dtype=torch.float64)
    expected = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(log_probs, scaled.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_row_chunked_sampling_equals_full_logits(config, tokenizer, policy, prompts, monkeypatch, temperature):
    """With a plain linear head the model returns hidden states and each step's logits are made
    and sampled a few rows at a time (here 3): the same tokens and log-probs as from the model's
    full [rows, V] logits, with the same seed."""
    import rltrainer.rollout.hf as hf

    chunked = make_engine(config, tokenizer, policy)
    assert chunked._head is chunked.model.lm_head
    full = make_engine(config, tokenizer, policy)
    full._head = None  # the model's own logits, all rows at once
    sampling = SamplingParams(temperature=temperature, max_new_tokens=12, n=3, seed=7)
    monkeypatch.setattr(hf, "SAMPLE_ELEMENTS", {"cpu": 3 * config.vocab_size, "cuda": 3 * config.vocab_size})
    got, expected = chunked.generate(prompts, sampling), full.generate(prompts, sampling)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.equal(got.response_mask, expected.response_mask)
    torch.testing.assert_close(got.log_probs, expected.log_probs, rtol=0, atol=1e-5)
    assert "forward" not in chunked.model.lm_head.__dict__  # the head is restored after generate
    compiled = HFEngine(compile=True)
    compiled.setup(config, tokenizer)
    assert compiled._head is None  # under torch.compile the model keeps its own head


def test_preallocated_cache_matches_dynamic_cache(config):
    from transformers import DynamicCache

    from rltrainer.rollout.hf import _preallocated_cache

    ours, theirs = _preallocated_cache(config, capacity=4), DynamicCache(config=config)
    torch.manual_seed(0)
    for step, t in enumerate([3, 1, 1, 2, 1]):  # prefill, decode, then past the capacity
        if step == 3:  # drop a row, as the engine does when rows finish
            for cache in (ours, theirs):
                cache.batch_select_indices(torch.tensor([0, 2]))
        b = 3 if step < 3 else 2
        k, v = torch.randn(b, 2, t, 16), torch.randn(b, 2, t, 16)
        for layer in range(config.num_hidden_layers):
            got, expected = ours.update(k, v, layer), theirs.update(k, v, layer)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert ours.get_seq_length() == theirs.get_seq_length() == 8

"""The family matrix: every family of ``rltrainer.testing.families`` (dense and mixture of experts)
trains on ``single`` and ``fsdp2`` or is refused at setup with its reason, and nothing gives
silently different log-probs:

- the trainer's per-token log-probs and entropies (chunked LM head and full logits, padded and
  packed rows) equal each row's own plain forward; where packing is refused (gpt-oss) the refusal
  and its reason are checked instead;
- two GRPO steps on 2 FSDP2 ranks (over Ray, warm processes) equal the same steps on ``single``:
  losses, gradient norms and updated weights; a MoE's fused ``[E, ...]`` experts shard on dim 0
  (8 experts: 4 per rank);
- the ``hf`` engine's sampled log-probs equal the trainer's on the same rows;
- the HF export writes what ``save_pretrained`` writes (MoE experts one by one) and reloads with
  ``from_pretrained`` to the same logits; a hub MoE checkpoint (experts one by one) loads on
  ``fsdp2``, 1 and 2 ranks, to ``from_pretrained``'s weights, each rank reading only its experts;
  the buffers a checkpoint stores (DeepSeek-V3's router bias) reach the engine and the export;
- what a strategy refuses (packing gpt-oss, a config ``AutoModelForCausalLM`` does not build, a
  vision-language model, activation checkpointing without support, no blocks for FSDP2) is refused
  at setup, with the reason.

Megatron's own families are tested in tests/strategies/ (``test_model_families.py``,
``test_megatron_*``); the docs' table of all of them is ``rltrainer.testing.family_table``."""

from __future__ import annotations

import pytest
import torch

from rltrainer import GRPO
from rltrainer.data.batch import RolloutBatch
from rltrainer.hf_export import save_pretrained_dir
from rltrainer.models import build_causal_lm, chunkable_head, persistent_buffers, response_log_probs, state_tensors
from rltrainer.models.support import packing_problem
from rltrainer.rollout import HFEngine, SamplingParams
from rltrainer.strategies import FSDP2Strategy, SingleDeviceStrategy
from rltrainer.testing import length_reward, prepared_batch
from rltrainer.testing.families import DENSE, MOE, tiny_config

FAMILIES = DENSE + MOE
VOCAB = 120
#: Families whose packed rows would attend to each other, and the reason setup gives.
PACKING_REFUSED = {"gpt_oss": "find_packed_sequence_indices is never reached"}


def model_of(family: str) -> torch.nn.Module:
    """``family``'s tiny model with weights 5x the default init's scale: peaked distributions, whose
    log-probs depend on the context (a padding leak would show)."""
    return build_causal_lm(tiny_config(family, VOCAB, initializer_range=0.1), seed=0).eval()


def ragged_batch(rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """``(prompt, response)`` token lists as the trainer lays them out: prompts left-padded,
    responses right-padded, one all-padding column on each side."""
    P, T = max(len(p) for p, _ in rows) + 1, max(len(r) for _, r in rows) + 1
    pad = VOCAB - 1
    ids, mask = torch.full((len(rows), P + T), pad), torch.zeros((len(rows), P + T), dtype=torch.long)
    responses = torch.full((len(rows), T), pad)
    for i, (prompt, response) in enumerate(rows):
        ids[i, P - len(prompt):P + len(response)] = torch.tensor(prompt + response)
        mask[i, P - len(prompt):P + len(response)] = 1
        responses[i, :len(response)] = torch.tensor(response)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": responses, "response_mask": mask[:, P:]}


def own_forward(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]],
                T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of each row's response from ``model(input_ids).logits`` of that row
    alone (no padding, no mask), ``[n, T]`` with 0 past each response."""
    log_probs, entropy = torch.zeros(len(rows), T), torch.zeros(len(rows), T)
    with torch.no_grad():
        for i, (prompt, response) in enumerate(rows):
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
            log_softmax = logits.float().log_softmax(-1)
            log_probs[i, :len(response)] = log_softmax.gather(-1, torch.tensor(response)[:, None])[:, 0]
            entropy[i, :len(response)] = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


# -- (a) log-probs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_log_probs_and_entropies_equal_each_rows_own_forward(family):
    """Rows of different prompt and response lengths, in fp32: the chunked head (in chunks of 5
    tokens) and the full logits (``chunk_tokens=0``), padded and packed, all within 1e-5 of each
    row's plain forward (observed: at most 2e-6 for both)."""
    model = model_of(family)
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(0, VOCAB - 1, (p,), generator=g).tolist(), torch.randint(0, VOCAB - 1, (t,),
                                                                                    generator=g).tolist())
            for p, t in [(5, 7), (3, 4), (9, 1), (2, 6)]]
    batch = ragged_batch(rows)
    mask = batch["response_mask"].bool()
    expected_lp, expected_entropy = own_forward(model, rows, mask.shape[1])
    assert expected_lp[mask].std() > 0.05  # the rows' contexts matter: a padding leak would show
    assert chunkable_head(model) is not None  # every family's head is taken by the chunked path
    problem = packing_problem(model)
    if family in PACKING_REFUSED:
        assert PACKING_REFUSED[family] in problem
    else:
        assert problem is None
    for padding_free in (False, True) if problem is None else (False,):
        for chunk_tokens in (5, 0):
            with torch.no_grad():
                log_probs, entropy = response_log_probs(model, batch, with_entropy=True, chunk_tokens=chunk_tokens,
                                                        padding_free=padding_free)
            where = f"padding_free={padding_free}, chunk_tokens={chunk_tokens}"
            torch.testing.assert_close(log_probs[mask], expected_lp[mask], rtol=0, atol=1e-5, msg=where)
            torch.testing.assert_close(entropy[mask], expected_entropy[mask], rtol=0, atol=1e-5, msg=where)


@pytest.mark.parametrize("family", sorted(PACKING_REFUSED))
def test_packing_is_refused_at_setup_with_the_reason(family, bpe_tokenizer):
    module = GRPO(tiny_config(family, len(bpe_tokenizer)), bpe_tokenizer, reward_funcs=length_reward,
                  num_generations=2, max_new_tokens=4)
    for strategy in (SingleDeviceStrategy(device="cpu", padding_free=True), FSDP2Strategy(devices=1,
                                                                                         padding_free=True)):
        try:
            with pytest.raises(ValueError, match=rf"padding_free=True .*{PACKING_REFUSED[family]}.*"
                                                 r"Use padding_free=False") as info:
                strategy.setup(module, seed=0)
        finally:
            strategy.teardown()
        assert "FSDP" not in str(info.value)  # the model's own class, not FSDP2's wrapper


# -- refusals at setup ------------------------------------------------------------------------------
def llava(tokenizer) -> torch.nn.Module:
    """A tiny vision-language model: its text config (Llama) is a causal LM's, its own is not."""
    import transformers as tf

    text = tiny_config("llama", len(tokenizer)).to_dict()
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=28, patch_size=14)
    return tf.LlavaForConditionalGeneration(tf.LlavaConfig(text_config=text, vision_config=vision.to_dict()))


def without(attribute: str, value, tokenizer) -> torch.nn.Module:
    """A tiny Llama whose ``attribute`` is ``value`` (what a model without that support declares)."""
    model = build_causal_lm(tiny_config("llama", len(tokenizer)), seed=0)
    setattr(model, attribute, value)
    return model


STRATEGIES = {"single": lambda **o: SingleDeviceStrategy(device="cpu", **o), "fsdp2": lambda **o: FSDP2Strategy(**o)}
REFUSALS = [  # (what is missing, the policy, strategy options, the strategies that check it, the reason)
    ("not_a_causal_lm_config", lambda tok: __import__("transformers").T5Config(
        vocab_size=len(tok), d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8), {}, ("single", "fsdp2"),
     r"T5Config \(model_type='t5'\), which AutoModelForCausalLM does not build"),
    ("vision_language_model", lambda tok: (lambda: llava(tok)), {}, ("single", "fsdp2"),
     r"LlavaConfig \(model_type='llava'\), which AutoModelForCausalLM does not build.*its text config"),
    ("no_gradient_checkpointing", lambda tok: (lambda: without("supports_gradient_checkpointing", False, tok)),
     {"activation_checkpointing": True}, ("fsdp2",),
     r"LlamaForCausalLM, which transformers marks supports_gradient_checkpointing=False. Turn activation_check"),
    ("no_blocks_to_shard", lambda tok: (lambda: without("_no_split_modules", ["NoSuchLayer"], tok)), {}, ("fsdp2",),
     r"names \['NoSuchLayer'\] and holds none of them. Use strategy='single'"),
]


@pytest.mark.parametrize("what, policy, options, reason, strategy", [
    pytest.param(what, policy, options, reason, strategy, id=f"{what}-{strategy}")
    for what, policy, options, strategies, reason in REFUSALS for strategy in strategies])
def test_a_refused_model_gets_its_reason_at_setup(what, policy, options, reason, strategy, bpe_tokenizer):
    module = GRPO(policy(bpe_tokenizer), bpe_tokenizer, reward_funcs=length_reward, num_generations=2,
                  max_new_tokens=4)
    trainer = STRATEGIES[strategy](**options)
    try:
        with pytest.raises(ValueError, match=reason):
            trainer.setup(module, seed=0)
    finally:
        trainer.teardown()


@pytest.mark.parametrize("family, layer", [("llama4_text", "Llama4Router, an nn.Linear with a forward of its own"),
                                           ("qwen3_moe", r"mlp.experts \(ParamWrapper\): only linear layers")])
def test_lora_on_a_moe_router_or_experts_is_refused_at_setup(family, layer, bpe_tokenizer):
    """``target_modules="all-linear"`` reaches a MoE's router (Llama 4's is an ``nn.Linear`` that
    returns a tuple) or its fused experts: refused, naming the layer."""
    import peft

    module = GRPO(tiny_config(family, len(bpe_tokenizer)), bpe_tokenizer, reward_funcs=length_reward,
                  num_generations=2, max_new_tokens=4, lora=peft.LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match=f"LoRA on .*{layer}"):
        SingleDeviceStrategy(device="cpu").setup(module, seed=0)


# -- (b) single vs fsdp2 ---------------------------------------------------------------------------
def make_module(family: str, tokenizer, **kwargs) -> GRPO:
    # lr 1e-4, as test_fsdp2.py (see make_module there: Adam's first step amplifies roundings near 0). The
    # routers' load-balancing loss is off: it is each micro-batch's (its shares of tokens per expert times its mean
    # router probabilities), so it changes with how rows are split into micro-batches and ranks. With it on (Mixtral,
    # coefficient 0.02), one device and 2 ranks agree on the losses and gradient norm within 2e-5, but two Adam
    # steps move embedding rows of near-zero gradient up to 2e-4 apart.
    defaults = dict(reward_funcs=length_reward, num_generations=4, max_new_tokens=6, lr=1e-4, kl_coef=0.05,
                    entropy_coef=0.01, router_aux_loss_coef=0.0)
    return GRPO(tiny_config(family, len(tokenizer)), tokenizer, **{**defaults, **kwargs})


@pytest.fixture(scope="module")
def short_prompts(gsm8k_prompts):
    """The 3 shortest GSM8K prompts, as one prompt batch."""
    order = sorted(range(len(gsm8k_prompts)), key=lambda i: len(gsm8k_prompts[i]["prompt_ids"]))
    return RolloutBatch.from_rows([gsm8k_prompts[i] for i in order[:3]])


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("family, padding_free", [(f, False) for f in FAMILIES] + [("qwen3_moe", True)])
def test_two_grpo_steps_on_two_fsdp2_ranks_equal_single(family, padding_free, bpe_tokenizer, short_prompts,
                                                        ray_session):
    """The same 12 rollouts, two GRPO steps: 2 FSDP2 ranks (6 rows each, micro-batches of 4: one
    short) and one device agree on the losses, gradient norms and every updated weight (observed:
    weights within 9e-7 of each other, gradient norms within a relative 2e-5, losses within 3e-8;
    asserted: 1e-5, 1e-4 and 1e-6). Padded rows, and a MoE's packed ones."""
    single_module = make_module(family, bpe_tokenizer)
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=8, padding_free=padding_free)
    single.setup(single_module, seed=7)
    torch.manual_seed(0)
    batch = prepared_batch(single_module, single, short_prompts)
    assert batch["advantages"].abs().sum() > 0

    fsdp = FSDP2Strategy(devices=2, micro_batch_size=4, padding_free=padding_free)
    try:
        fsdp.setup(make_module(family, bpe_tokenizer), seed=7)
        before = dict(fsdp.export_weights())
        for name, p in single_module.policy.named_parameters():
            assert torch.equal(before[name], p.detach()), name  # the same init on both
        for _ in range(2):
            m_single, m_fsdp = single.train_step(batch), fsdp.train_step(batch)
            for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
                assert m_fsdp[key] == pytest.approx(m_single[key], rel=1e-4, abs=1e-6), key
        after = dict(fsdp.export_weights())
        for name, p in single_module.policy.named_parameters():
            torch.testing.assert_close(after[name], p.detach(), rtol=0, atol=1e-5, msg=name)
            assert not torch.equal(p.detach(), before[name]), name  # the step reached every tensor
    finally:
        fsdp.teardown()


# -- (c) the hf engine -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_engine_log_probs_equal_the_trainers(family):
    """fp32 on both sides, temperature 0.8: the ``hf`` engine's log-probs of the tokens it sampled
    (KV cache, left-padded prompts, rows dropped from the batch as they stop) equal the trainer's
    ``response_log_probs`` over the same rows (observed: at most 2.4e-6; asserted: 1e-5)."""
    model = model_of(family)
    engine = HFEngine(share_weights=False)
    engine.setup(model.config, ByteTokenizer())
    engine.update_weights(model.state_dict().items())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (3, 8, 5)]
    sampling = SamplingParams(n=2, max_new_tokens=10, temperature=0.8, stop_token_ids=list(range(0, VOCAB, 9)),
                              seed=0)
    gen = engine.generate(prompts, sampling)
    lengths = gen.response_mask.sum(1).tolist()
    assert min(lengths) < max(lengths)  # rows of different lengths: some stopped early
    rows = [(prompts[i // 2], gen.response_ids[i, :n].tolist()) for i, n in enumerate(lengths)]
    batch = ragged_batch(rows)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, batch, temperature=0.8)
    sampled = torch.nn.functional.pad(gen.log_probs, (0, mask.shape[1] - gen.log_probs.shape[1]))  # [6, T]
    torch.testing.assert_close(log_probs[mask], sampled[mask], rtol=0, atol=1e-5)


class ByteTokenizer:
    """What the ``hf`` engine asks of a tokenizer: a pad id and ``batch_decode``."""

    pad_token_id = VOCAB - 1
    eos_token_id = VOCAB - 1

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, row)) for row in rows]


# -- (d) export and hub checkpoints ----------------------------------------------------------------
def policy_of(family: str, tokenizer) -> tuple[SingleDeviceStrategy, torch.nn.Module]:
    module = make_module(family, tokenizer)
    strategy = SingleDeviceStrategy(device="cpu")
    strategy.setup(module, seed=1)
    return strategy, module.policy


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_what_save_pretrained_writes_and_reloads_to_the_same_logits(family, bpe_tokenizer, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    strategy, policy = policy_of(family, bpe_tokenizer)
    out = save_pretrained_dir(strategy.export_weights(), strategy.model_config(), tmp_path / "export")
    policy.save_pretrained(tmp_path / "hf")
    exported, saved = load_file(out / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(saved)  # the hub's names: MoE experts one by one
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, len(bpe_tokenizer), (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, policy.eval()(input_ids=ids).logits)


def hub_checkpoint(family: str, tokenizer, path):
    """A tiny random model of ``family`` saved as the hub stores it (``save_pretrained``: a MoE's
    experts one by one), with its persistent buffers (DeepSeek-V3's ``e_score_correction_bias``)
    set to values a model built from the config does not have."""
    model = build_causal_lm(tiny_config(family, len(tokenizer)), seed=2)
    with torch.no_grad():
        for buffer in persistent_buffers(model).values():
            buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(path)
    return path


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("family", MOE)
def test_a_hub_moe_checkpoint_loads_on_fsdp2_as_from_pretrained(family, devices, bpe_tokenizer, tmp_path,
                                                                ray_session):
    """The fsdp2 policy equals ``from_pretrained``'s, parameters and persistent buffers; each rank
    read from the files exactly the bytes of its rows (2 ranks: 4 of the 8 experts each)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = hub_checkpoint(family, bpe_tokenizer, tmp_path / "hub")
    with safe_open(path / "model.safetensors", "pt") as f:
        per_expert = any(".experts.0." in key for key in f.keys())
    assert per_expert == (family not in ("gpt_oss", "llama4_text"))  # those two store them fused on the hub too
    plain = AutoModelForCausalLM.from_pretrained(path)
    fsdp = FSDP2Strategy(devices=devices)
    try:
        fsdp.setup(GRPO(str(path), bpe_tokenizer, reward_funcs=length_reward, num_generations=2), seed=0)
        loaded = dict(fsdp.export_weights())
        reports = fsdp.group.execute_all("load_report")
    finally:
        fsdp.teardown()
    expected = state_tensors(plain)
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor.detach()), name
    for report in reports:
        assert report["policy"]["read_bytes"] == report["policy"]["shard_bytes"]
        assert devices == 1 or report["policy"]["shard_bytes"] < 0.6 * report["policy"]["full_bytes"]


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("strategy", ["single", "fsdp2"])
def test_a_checkpoints_buffers_reach_the_engine_and_the_export(strategy, bpe_tokenizer, short_prompts, tmp_path,
                                                               ray_session):
    """DeepSeek-V3's router bias is a buffer its checkpoint stores: it travels with the weights, so
    the engine (built from the config) samples from the trained model, not from one with a zero
    bias, and the export holds it."""
    from transformers import AutoModelForCausalLM

    path = hub_checkpoint("deepseek_v3", bpe_tokenizer, tmp_path / "hub")
    (name, bias), = persistent_buffers(AutoModelForCausalLM.from_pretrained(path)).items()
    assert bias.abs().sum() > 0
    module = GRPO(str(path), bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=6)
    trainer = SingleDeviceStrategy(device="cpu") if strategy == "single" else FSDP2Strategy(devices=2)
    try:
        trainer.setup(module, seed=0)
        torch.manual_seed(0)
        batch = prepared_batch(module, trainer, short_prompts)
        mask = batch["response_mask"].bool()
        old = trainer.compute(batch, "old_log_prob")["old_log_probs"]
        torch.testing.assert_close(batch["rollout_log_probs"][mask], old[mask], rtol=0, atol=1e-5)
        out = save_pretrained_dir(trainer.export_weights(), trainer.model_config(), tmp_path / "export")
    finally:
        trainer.teardown()
    assert torch.equal(persistent_buffers(AutoModelForCausalLM.from_pretrained(out))[name], bias)

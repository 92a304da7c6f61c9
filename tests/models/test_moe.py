"""Mixture-of-experts policies (rltrainer/models/moe.py): the routers each family declares, routing
replay (R3: the trainer routes exactly as the given routes say, with the router still learning,
padded or packed, under activation checkpointing), the load-balancing loss against transformers'
own, the ``hf`` engine's recorded routes, and the routing part in a GRPO run (metrics; rows keep
the routes of the weights that generated them in the async pipelines)."""

from __future__ import annotations

import pytest
import torch

from rltrainer import GRPO, Trainer, prompt_dataloader
from rltrainer.data.batch import routes_as_rows
from rltrainer.models import build_causal_lm, response_log_probs
from rltrainer.models.moe import (capturing, moe_of, recording, routing_shape, summarize_routing_metrics,
                                  take_routes)
from rltrainer.rollout import HFEngine
from rltrainer.rollout.engine import SamplingParams
from rltrainer.testing import length_reward
from rltrainer.testing.families import MOE, tiny_config

VOCAB, P, T = 120, 6, 7


def rows(seed: int = 0, n: int = 3) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of different lengths, as the hooks see them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (n, P + T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, P + 4:] = 0
    mask[2, :1] = 0
    mask[2, P + 5:] = 0
    return {"input_ids": ids * mask, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, P:] * mask[:, P:], "response_mask": mask[:, P:]}


def own_routes(model, batch) -> torch.Tensor:
    """The experts ``model`` picks by itself for every token of ``batch``: ``[n, P+T, L, K]``."""
    routing = moe_of(model)
    with torch.no_grad(), capturing(model):
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              position_ids=batch["position_ids"])
        return take_routes(routing, batch["input_ids"].numel()).unflatten(0, batch["input_ids"].shape)


def used_routes(model, batch, routes, **kwargs) -> tuple[torch.Tensor, list]:
    """The log-probs of ``batch`` replaying ``routes``, and per router call ``(layer, the experts it
    used, the real tokens)``."""
    seen = []
    with recording(model) as record:
        add = record.add

        def spy(layer, logits, own, chosen, engine, valid):
            seen.append((layer, chosen.clone(), valid))
            add(layer, logits, own, chosen, engine, valid)

        record.add = spy
        log_probs, _ = response_log_probs(model, batch, routed_experts=routes, **kwargs)
    return log_probs, seen


@pytest.mark.parametrize("family", MOE)
def test_each_family_declares_one_router_per_moe_layer(family):
    config = tiny_config(family, VOCAB)
    routing = moe_of(build_causal_lm(config, seed=0))
    layers, experts, top_k = routing_shape(config)
    assert (routing.layers, routing.experts, routing.top_k) == (layers, experts, top_k)
    first_moe = getattr(config, "first_k_dense_replace", 0)  # DeepSeek-V3's dense first layer
    assert [r.layer for r in routing.routers] == list(range(first_moe, layers))


@pytest.mark.parametrize("family", MOE)
def test_replay_routes_exactly_as_given_and_the_router_still_learns(family):
    """Routes that differ from the router's own choice (every expert shifted by one) are the experts
    used, for every real token and MoE layer; the log-probs move; the router weight gets a gradient.
    Replaying the router's own routes changes nothing."""
    model = build_causal_lm(tiny_config(family, VOCAB), seed=0)
    batch = rows()
    own = own_routes(model, batch)  # [n, P+T, L, K]
    plain, _ = response_log_probs(model, batch)
    same, _ = response_log_probs(model, batch, routed_experts=own)
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
    experts = moe_of(model).experts
    shifted = torch.where(own >= 0, (own + 1) % experts, own)
    model.zero_grad()
    log_probs, seen = used_routes(model, batch, shifted)
    (log_probs * batch["response_mask"]).sum().backward()
    real = batch["attention_mask"].bool().flatten()
    for layer, chosen, valid in seen:
        expected = shifted.flatten(0, 1)[:, layer]
        kept = valid if valid is not None else real
        assert torch.equal(chosen.sort(-1).values[kept], expected.long().sort(-1).values[kept]), layer
    assert not torch.allclose(log_probs, plain)
    routers = [p for n, p in model.named_parameters() if n.endswith(("gate.weight", "router.weight"))
               and p.shape[0] == experts]
    assert routers and all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)


def test_replay_is_the_same_packed_and_under_activation_checkpointing():
    """Packed rows take the same routes (their tokens in packed order); a layer recomputed in the
    backward replays the forward's routes (and the record adds nothing it would have to save), so
    the gradients, the load-balancing loss's included, equal those without checkpointing."""
    config = tiny_config("qwen3_moe", VOCAB)
    batch = rows(1)
    shifted = (own_routes(build_causal_lm(config, seed=0), batch) + 3) % 8
    results = []
    for padding_free, checkpointing in ((False, False), (True, False), (False, True)):
        model = build_causal_lm(config, seed=0)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        with recording(model) as record:  # its load-balancing loss in the backward too
            log_probs, _ = response_log_probs(model, batch, routed_experts=shifted, padding_free=padding_free)
        ((log_probs * batch["response_mask"]).sum() + record.aux_loss()).backward()
        results.append((log_probs.detach() * batch["response_mask"], {n: p.grad for n, p in model.named_parameters()}))
    for log_probs, grads in results[1:]:
        torch.testing.assert_close(log_probs, results[0][0], rtol=1e-5, atol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, results[0][1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "olmoe", "qwen2_moe"])
def test_the_load_balancing_loss_is_transformers(family):
    model = build_causal_lm(tiny_config(family, VOCAB), seed=0)
    batch = rows(2)
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"], output_router_logits=True).aux_loss
    for padding_free in (False, True) if family != "gpt_oss" else (False,):  # gpt-oss's packed rows mix
        with recording(model) as record:
            response_log_probs(model, batch, padding_free=padding_free)
        torch.testing.assert_close(record.aux_loss(), expected, rtol=1e-5, atol=1e-6)


def test_the_routing_metrics_sum_exactly_and_summarise():
    model = build_causal_lm(tiny_config("qwen3_moe", VOCAB), seed=0)
    batch = rows(3)
    routes = own_routes(model, batch)
    with recording(model) as whole:
        response_log_probs(model, batch, routed_experts=routes, replay_routes=False)
    parts = []
    for part in ({k: v[:1] for k, v in batch.items()}, {k: v[1:] for k, v in batch.items()}):
        with recording(model) as record:
            response_log_probs(model, part, routed_experts=routes[:1] if len(part["input_ids"]) == 1 else routes[1:],
                               replay_routes=False)
        parts.append(record.metrics())
    for name, value in whole.metrics().items():
        torch.testing.assert_close(parts[0][name] + parts[1][name], value, rtol=1e-5, atol=1e-4)
    real = int(batch["attention_mask"].sum())
    assert whole.expert_tokens.sum() == real * 2 * 2  # tokens x layers x top-2
    summary = summarize_routing_metrics({**whole.metrics(), "training/optimizer_steps": 1.0})
    assert summary["moe/routing_agreement"] == 1.0  # its own routes, compared
    assert 0 < summary["moe/expert_share/min"] <= 1 / 8 <= summary["moe/expert_share/max"] < 1
    assert summary["moe/tokens_per_expert/mean"] == pytest.approx(real * 2 / 8)
    assert 0 < summary["moe/router_entropy"] < torch.log(torch.tensor(8.0))
    assert {"moe/layer0/expert_share/max", "moe/layer1/router_entropy"} <= summary.keys()
    assert not any(isinstance(v, torch.Tensor) for v in summary.values())


def test_routes_for_a_dense_model_or_of_the_wrong_shape_are_refused():
    dense = build_causal_lm(tiny_config("qwen3", VOCAB), seed=0)
    batch = rows()
    with pytest.raises(ValueError, match="no MoE routers declared"):
        response_log_probs(dense, batch, routed_experts=torch.zeros(3, P + T, 2, 2, dtype=torch.int16))
    moe = build_causal_lm(tiny_config("qwen3_moe", VOCAB), seed=0)
    with pytest.raises(ValueError, match=r"takes \[tokens, 2 layers, 2 experts per token\]"):
        response_log_probs(moe, batch, routed_experts=torch.zeros(3, P + T, 2, 3, dtype=torch.int16))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        engine = HFEngine()
        engine.return_routed_experts = True
        engine.setup(tiny_config("qwen3", VOCAB), _Tokenizer())


class _Tokenizer:
    pad_token_id = VOCAB - 1
    eos_token_id = VOCAB - 1

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, row)) for row in ids]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_hf_engine_records_the_routes_it_generated_with(family):
    """Per row ``[prompt + response, L, K]``; replayed by the trainer on the same fp32 weights they
    give the engine's own log-probs, and they are the trainer's own choice."""
    config = tiny_config(family, VOCAB)
    policy = build_causal_lm(config, seed=0)
    engine = HFEngine(max_batch_size=3)  # two chunks for 2 prompts x 2 samples
    engine.return_routed_experts = True
    engine.setup(config, _Tokenizer())
    engine.update_weights(policy.named_parameters())
    prompts = [[5, 6, 7, 8], [9, 10]]
    gen = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=T, seed=0, stop_token_ids=[]))
    lengths = gen.response_mask.sum(1).tolist()
    assert [tuple(r.shape) for r in gen.routed_experts] == [(len(prompts[i // 2]) + lengths[i], 2, 2) for i in range(4)]
    width = max(map(len, prompts))
    routes = routes_as_rows(gen.routed_experts, [len(prompts[i // 2]) for i in range(4)], width, gen.response_ids.shape[1])
    ids = torch.zeros(4, width + gen.response_ids.shape[1], dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(4):
        p = prompts[i // 2]
        ids[i, width - len(p):width] = torch.tensor(p)
        mask[i, width - len(p):] = torch.cat([torch.ones(len(p)), gen.response_mask[i]]).long()
    ids[:, width:] = gen.response_ids
    batch = {"input_ids": ids * mask, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
             "responses": gen.response_ids}
    for i, length in enumerate(lengths):  # the last sampled token is never run
        assert (routes[i, width + length - 1] == -1).all() and (routes[i, width + length - 2, 1] >= 0).all()
    first_moe = getattr(config, "first_k_dense_replace", 0)
    assert (routes[:, :, :first_moe] == -1).all()
    with torch.no_grad():
        replayed, _ = response_log_probs(policy, batch, routed_experts=routes)
        with recording(policy) as record:
            response_log_probs(policy, batch, routed_experts=routes, replay_routes=False)
    torch.testing.assert_close(replayed * gen.response_mask, gen.log_probs * gen.response_mask, rtol=1e-4, atol=1e-5)
    assert float(record.agreement[:, 0].sum() / record.agreement[:, 1].sum()) == 1.0


def test_grpo_replays_and_logs_the_moe_metrics(bpe_tokenizer, gsm8k_prompts):
    """On ``single``: the engine records routes (the batch carries them), the step logs the MoE
    metrics, the router's aux loss term is in the loss (its coefficient from the config), and
    ``routing_replay="off"`` records nothing."""
    logged = []
    module = GRPO(tiny_config("qwen3_moe", len(bpe_tokenizer)), bpe_tokenizer, reward_funcs=length_reward,
                  num_generations=2, max_new_tokens=6, lr=1e-3)
    original = module.reward_step

    def reward_step(batch):
        logged.append(batch["routed_experts"].shape if "routed_experts" in batch else None)
        return original(batch)

    module.reward_step = reward_step
    with Trainer(strategy="single", max_steps=2, logger=False, enable_progress_bar=False) as trainer:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
        metrics = trainer.callback_metrics
    assert all(shape is not None and shape[2:] == (2, 2) for shape in logged)
    assert metrics["moe/routing_agreement"] == 1.0  # the same fp32 weights route alike
    assert {"moe/expert_share/max", "moe/router_entropy", "moe/aux_loss", "moe/layer1/expert_share/min"} <= metrics.keys()
    off = GRPO(tiny_config("qwen3_moe", len(bpe_tokenizer)), bpe_tokenizer, reward_funcs=length_reward,
               num_generations=2, max_new_tokens=6, routing_replay="off")
    assert not off.records_routes() and off.parts["routing"].coefficient(build_causal_lm(
        tiny_config("qwen3_moe", len(bpe_tokenizer)), seed=0)) == 0.001

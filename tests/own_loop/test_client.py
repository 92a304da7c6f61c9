"""The in-process primitives (rltrainer.own_loop.TrainingClient) against direct computations: each
Tinker loss's value and gradient, AdamW's step, state round trips, and the sampling client's weights."""

from __future__ import annotations

import copy

import pytest
import torch

from rltrainer.own_loop import AdamParams, Datum, SamplingParams, TrainingClient

SEQS = [[5, 9, 13, 22, 31, 7], [40, 41, 42, 43]]


@pytest.fixture
def client(bpe_tokenizer, tiny_config, tmp_path):
    return TrainingClient(tiny_config, bpe_tokenizer, strategy="single", device="cpu", root=tmp_path)


def datums(seed: int = 0) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for seq in SEQS:
        n = len(seq) - 1
        out.append(Datum(seq[:-1], {"target_tokens": torch.tensor(seq[1:]),
                                     "weights": torch.tensor([0.0] + [1.0] * (n - 1)),
                                     "advantages": torch.randn(n, generator=g),
                                     "logprobs": -torch.rand(n, generator=g) * 8,
                                     "sequence_ratio_mask": torch.tensor([0.0] + [1.0] * (n - 1))}))
    return out


def direct_logprobs(model: torch.nn.Module, d: Datum) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([list(d.model_input)]), use_cache=False).logits[0].float()  # [N, V]
    return logits.log_softmax(-1).gather(-1, d.loss_fn_inputs["target_tokens"][:, None])[:, 0]


def direct_loss(name: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tinker's documented formulas (https://tinker-docs.thinkingmachines.ai/tinker/losses), as sums."""
    ratio = torch.exp(lp - inputs["logprobs"])
    adv = inputs["advantages"]
    if name == "cross_entropy":
        return -(lp * inputs["weights"]).sum()
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    if name == "ppo":
        return -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum()
    if name == "cispo":
        return -(ratio.clamp(0.8, 1.2).detach() * lp * adv).sum()
    if name == "dro":
        return -(lp * adv - 0.5 * 0.05 * (lp - inputs["logprobs"]) ** 2).sum()
    if name == "gspo":  # /losses/gspo: the masked tokens' mean log-ratio, each token's own gradient
        in_ratio = inputs["sequence_ratio_mask"] != 0
        s = torch.exp((lp.detach() - inputs["logprobs"])[in_ratio].mean() + lp - lp.detach())
        return -torch.minimum(s * adv, s.clamp(0.8, 1.2) * adv).sum()
    raise AssertionError(name)


def grads_of(client: TrainingClient) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in client.strategy.module.policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_each_loss_value_and_gradient_match_the_documented_sum(client, loss_fn):
    reference = copy.deepcopy(client.strategy.module.policy)
    data = datums()
    out = client.forward_backward(data, loss_fn).result()
    lps = [direct_logprobs(reference, d) for d in data]
    expected = sum(direct_loss(loss_fn, lp, d.loss_fn_inputs) for lp, d in zip(lps, data))
    assert out.metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-5, abs=1e-5)
    for got, lp in zip(out.loss_fn_outputs, lps):
        torch.testing.assert_close(got["logprobs"], lp.detach(), rtol=1e-5, atol=1e-5)
    expected.backward()
    client.optim_step(AdamParams(learning_rate=0.0)).result()  # gradients stay in .grad; lr 0 moves nothing
    grads = grads_of(client)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


def test_gradients_of_two_calls_add_up_before_the_step(client):
    reference = copy.deepcopy(client.strategy.module.policy)
    data = datums()
    client.forward_backward(data[:1], "importance_sampling")
    client.forward_backward(data[1:], "cross_entropy")
    client.optim_step(AdamParams(learning_rate=0.0)).result()
    loss = (direct_loss("importance_sampling", direct_logprobs(reference, data[0]), data[0].loss_fn_inputs)
            + direct_loss("cross_entropy", direct_logprobs(reference, data[1]), data[1].loss_fn_inputs))
    loss.backward()
    grads = grads_of(client)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


def test_a_custom_loss_trains_as_the_builtin_it_spells(client, bpe_tokenizer, tiny_config, tmp_path):
    other = TrainingClient(tiny_config, bpe_tokenizer, strategy="single", device="cpu", root=tmp_path / "b")
    data = datums()

    def custom(batch, logprobs):
        loss = sum(-(lp * d.loss_fn_inputs["weights"]).sum() for lp, d in zip(logprobs, batch))
        return loss, {"custom/ce:sum": float(loss)}

    out = client.forward_backward(data, custom).result()
    builtin = other.forward_backward(data, "cross_entropy").result()
    assert out.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-6)
    assert set(out.metrics) == {"custom/ce:sum", "loss:sum", "surrogate_loss:sum"}
    client.optim_step(AdamParams(learning_rate=0.0)).result()
    other.optim_step(AdamParams(learning_rate=0.0)).result()
    for name, g in grads_of(other).items():
        torch.testing.assert_close(grads_of(client)[name], g, rtol=1e-5, atol=1e-7)


def test_optim_step_moves_the_weights_as_torch_adamw(client):
    reference = copy.deepcopy(client.strategy.module.policy)
    adam = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    data = datums()
    for _ in range(2):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(adam).result()
        opt.zero_grad()
        sum(direct_loss("cross_entropy", direct_logprobs(reference, d), d.loss_fn_inputs) for d in data).backward()
        opt.step()
    for name, p in client.strategy.module.policy.named_parameters():
        # Adam divides by sqrt(v): a gradient near 0 turns float rounding into ~1 % of a step (lr 1e-2)
        torch.testing.assert_close(p.detach(), reference.get_parameter(name).detach(), rtol=1e-4, atol=2e-4)


def weights(client: TrainingClient) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in client.strategy.module.policy.named_parameters()}


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_save_and_load_state_round_trip_bit_equal(client, with_optimizer):
    data = datums()
    client.forward_backward(data, "cross_entropy")
    client.optim_step(AdamParams(learning_rate=1e-2)).result()
    path = client.save_state("ckpt").result()
    saved = weights(client)
    client.forward_backward(data, "cross_entropy")
    client.optim_step(AdamParams(learning_rate=1e-2)).result()
    after_saved_step = weights(client)
    load = client.load_state_with_optimizer if with_optimizer else client.load_state
    load(path).result()
    for name, w in weights(client).items():
        assert torch.equal(w, saved[name]), name
    client.forward_backward(data, "cross_entropy")
    client.optim_step(AdamParams(learning_rate=1e-2)).result()
    same = all(torch.equal(w, after_saved_step[name]) for name, w in weights(client).items())
    assert same == with_optimizer  # without the optimizer, Adam restarts (its first step differs)


def test_the_sampling_client_sees_the_pushed_weights(client):
    data = datums()
    before = client.save_weights_and_get_sampling_client().result()
    seq = SEQS[0]
    old = before.compute_logprobs(seq).result()
    client.forward_backward(data, "cross_entropy")
    client.optim_step(AdamParams(learning_rate=5e-2)).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    new = sampler.compute_logprobs(seq).result()
    trained = client.forward([Datum(seq[:-1], {"target_tokens": torch.tensor(seq[1:])})]).result()
    assert old[0] is None and new[0] is None
    torch.testing.assert_close(torch.tensor(new[1:]), trained.loss_fn_outputs[0]["logprobs"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(torch.tensor(old[1:]), torch.tensor(new[1:]))
    out = sampler.sample(seq[:3], 3, SamplingParams(max_tokens=4, seed=0, stop=[])).result()
    assert [len(s.tokens) for s in out.sequences] == [4, 4, 4]
    assert all(len(s.logprobs) == 4 and s.stop_reason == "length" for s in out.sequences)


def test_a_stop_string_of_several_tokens_ends_the_sample_where_it_completes(client, bpe_tokenizer):
    sampler = client.save_weights_and_get_sampling_client().result()
    params = SamplingParams(max_tokens=12, seed=0, stop=[])
    free = sampler.sample(SEQS[0][:3], 1, params).result().sequences[0]  # a seeded sample with no stop
    k = next(k for k in range(3, 12) if len(bpe_tokenizer.encode(bpe_tokenizer.decode(free.tokens[k - 2:k]),
                                                                    add_special_tokens=False)) > 1)
    stop = bpe_tokenizer.decode(free.tokens[k - 2:k])  # two of its tokens, a string of several tokens
    params.stop = [stop]
    cut = sampler.sample(SEQS[0][:3], 1, params).result().sequences[0]  # the same sample, cut at the stop
    end = next(j for j in range(1, 13) if stop in bpe_tokenizer.decode(free.tokens[:j]))
    assert (cut.tokens, cut.logprobs, cut.stop_reason) == (free.tokens[:end], free.logprobs[:end], "stop")


def test_plain_tensors_are_datums_too(client):
    rows = torch.tensor([[5, 9, 13, 22], [40, 41, 42, 43]])
    targets = torch.tensor([[9, 13, 22, 31], [41, 42, 43, 44]])
    from_tensors = client.forward({"model_input": rows, "target_tokens": targets}).result()
    from_datums = client.forward([Datum(r, {"target_tokens": t}) for r, t in zip(rows, targets)]).result()
    assert from_tensors.metrics == from_datums.metrics


def test_bad_input_names_what_is_allowed(client):
    with pytest.raises(ValueError, match="Unknown loss_fn 'ppo2'. Built in: cispo, cross_entropy, dro"):
        client.forward_backward(datums(), "ppo2").result()
    with pytest.raises(ValueError, match="lacks \\['logprobs'\\]"):
        client.forward_backward([Datum([1, 2], {"target_tokens": torch.tensor([2, 3]),
                                                "advantages": torch.ones(2)})], "ppo").result()
    with pytest.raises(RuntimeError, match="without a forward_backward"):
        client.optim_step().result()


def test_sampling_overlaps_training(client):
    """A sample submitted while forward_backward and optim_step are in flight runs on the sampling
    client's own thread and comes back; the training calls still run in their order."""
    import threading

    sampler = client.save_weights_and_get_sampling_client().result()
    threads = {}
    original = sampler._sample

    def sample(*args):
        threads["sample"] = threading.current_thread().name
        return original(*args)

    sampler._sample = sample
    fb = client.forward_backward(datums(), "cross_entropy")
    step = client.optim_step(AdamParams(learning_rate=1e-2))
    out = sampler.sample(SEQS[0][:3], 2, SamplingParams(max_tokens=3, seed=0)).result()
    assert len(out.sequences) == 2 and step.result().metrics["optim/step:max"] == 1.0 and fb.done()
    assert threads["sample"].startswith("rltrainer-sample")


def test_strategy_settings_with_a_strategy_instance_are_refused(tiny_config):
    from rltrainer.strategies import SingleDeviceStrategy

    with pytest.raises(ValueError, match=r"Strategy settings \['device'\] go to a strategy built by name"):
        TrainingClient(tiny_config, strategy=SingleDeviceStrategy(), device="cpu")


def test_lora_on_megatron_is_refused_before_any_rank_starts(tiny_config):
    from rltrainer.strategies import MegatronStrategy

    with pytest.raises(ValueError, match="MegatronStrategy trains every parameter, not LoRA adapters.*'fsdp2'"):
        TrainingClient(tiny_config, strategy=MegatronStrategy(devices=1), rank=4)

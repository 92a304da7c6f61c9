"""The primitives on every strategy against ``single``: ``megatron`` (one megatron-core rank in this
process, CPU; two on Ray, data- or tensor-parallel) and ``fsdp2`` (2 ranks on Ray, gloo) take each ``optim_step``'s ``AdamParams``
(learning rate, betas, eps, weight decay and ``grad_clip_norm``, changed between steps), and
``load_state`` (weights only: a fresh optimizer) / ``load_state_with_optimizer`` resume as
``single`` does.

Tolerances: the layouts compute the same steps in another order (megatron's fused QKV and its own
gradient norm, FSDP2's reduce-scatter), so gradients differ by fp32 rounding (~1e-7 relative).
``eps=1e-6`` keeps Adam from magnifying a ~0 gradient's rounding residue (up to ~2e-9, see
tests/strategies/test_megatron_strategy.py's ``LayoutGRPO``) beyond ``lr * 2e-9 / 1e-6`` a step:
at ``lr <= 3e-3`` and four steps at most, 2.4e-5 in the worst case; weights are compared to
``atol=2e-5`` (seen: below 1e-6), while a hyperparameter, a clip or a load not taken moves a
weight by ~``lr`` (1e-3) or more.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from rltrainer.own_loop import AdamParams, Datum, TrainingClient
from rltrainer.strategies import FSDP2Strategy, MegatronStrategy

pytestmark = pytest.mark.usefixtures("warm_ranks")  # fsdp2's ranks reuse warm processes (tests/conftest.py)

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed (dev extra: pip install -e '.[dev]')")
STRATEGIES = ["fsdp2", pytest.param("megatron", marks=needs_megatron)]
ATOL = 2e-5

A = AdamParams(learning_rate=1e-3, beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.1)
B = AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0)


def datums() -> list[Datum]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (5, 7, 3, 6, 4):  # on fsdp2: 3 rows on one rank, 2 and a padding row on the other
        seq = torch.randint(5, 4000, (n + 1,), generator=g)
        out.append(Datum(seq[:-1], {"target_tokens": seq[1:], "logprobs": -torch.rand(n, generator=g) * 8,
                                    "advantages": torch.randn(n, generator=g)}))
    return out


def client(name: str, config, tokenizer, root, request) -> TrainingClient:
    """``name``'s client, built with the strategy's own ``gradient_clip_val`` (1.0): each step's
    ``grad_clip_norm`` must override it. fsdp2's ranks join the session's Ray."""
    if name in ("fsdp2", "megatron-dp2", "megatron-tp2"):
        request.getfixturevalue("ray_session")
    strategy = {"single": lambda: "single", "fsdp2": lambda: FSDP2Strategy(devices=2),
                "megatron": lambda: MegatronStrategy(devices=1),
                "megatron-dp2": lambda: MegatronStrategy(devices=2),
                "megatron-tp2": lambda: MegatronStrategy(devices=2, tensor_model_parallel_size=2)}[name]()
    kwargs = {"device": "cpu"} if name == "single" else {}
    return TrainingClient(config, tokenizer, strategy=strategy, root=root / name, **kwargs)


@contextlib.contextmanager
def opened(names: tuple[str, ...], config, tokenizer, root, request):
    """``single``'s client and the other strategy's, closed at the end."""
    made: list[TrainingClient] = []
    try:
        made.extend(client(n, config, tokenizer, root, request) for n in names)
        yield made
    finally:
        for c in made:
            c.close()


def weights(c: TrainingClient) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in c.strategy.export_weights()}


def step(clients: list[TrainingClient], data: list[Datum], adam: AdamParams) -> list[dict[str, float]]:
    for c in clients:
        c.forward_backward(data, "ppo").result()
    return [c.optim_step(adam).result().metrics for c in clients]


def assert_stepped_with(c: TrainingClient, adam: AdamParams, grad_norm: float) -> None:
    """``single`` (in this process) stepped with ``adam``: its AdamW's hyperparameters are the
    step's, and the gradients it stepped with were clipped to ``grad_clip_norm`` (0: not at all).
    The other strategies are compared to it."""
    group = c.strategy.optimizers[0].param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == \
        (adam.learning_rate, (adam.beta1, adam.beta2), adam.eps, adam.weight_decay)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in c.strategy.module.policy.parameters()]))
    assert float(norm) == pytest.approx(adam.grad_clip_norm or grad_norm, rel=1e-4)


def assert_same_weights(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], when: str) -> None:
    assert got.keys() == expected.keys()
    for n, t in expected.items():
        torch.testing.assert_close(got[n], t, rtol=0, atol=ATOL, msg=lambda m, n=n: f"{when}, {n}: {m}")


@needs_megatron
def test_megatron_takes_each_steps_adam_params_as_single(tiny_config, bpe_tokenizer, tmp_path, request):
    """Steps under ``A`` (lr 1e-3, betas (0.5, 0.9), weight decay 0.1; none of them the defaults),
    then ``B`` (3x the lr, other betas, no decay): megatron-core's optimizer steps with each step's
    values, set on its param groups by the module's ``on_before_optimizer_step``."""
    data = datums()
    with opened(("single", "megatron"), tiny_config, bpe_tokenizer, tmp_path, request) as clients:
        for i, adam in enumerate((A, A, B)):
            metrics = step(clients, data, adam)
            assert_stepped_with(clients[0], adam, metrics[0]["grad_norm:mean"])
            for inner in clients[1].strategy.group.worker._optimizer.inner_optimizers():  # megatron-core's
                assert {(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in inner.param_groups} == \
                    {(adam.learning_rate, (adam.beta1, adam.beta2), adam.eps, adam.weight_decay)}
            assert metrics[1]["loss:sum"] == pytest.approx(metrics[0]["loss:sum"], rel=1e-5)
            assert_same_weights(*map(weights, clients), f"after step {i + 1}")


@needs_megatron
@pytest.mark.parametrize("name", ["megatron-dp2", "megatron-tp2"])
def test_two_megatron_ranks_take_each_steps_adam_params_and_clip_as_single(name, tiny_config, bpe_tokenizer,
                                                                           tmp_path, request):
    """Two megatron-core ranks on Ray: data-parallel (the distributed optimizer: each rank steps its
    shard of the parameters, so each rank's ``on_before_optimizer_step`` must set its own groups)
    and tensor-parallel (each rank steps its slices; the clip is over the global norm). ``A``, then
    ``B`` with a clip that binds: the same loss, gradient norm and weights as ``single``."""
    data = datums()
    clipped = AdamParams(learning_rate=B.learning_rate, beta1=B.beta1, beta2=B.beta2, eps=B.eps, grad_clip_norm=0.5)
    with opened(("single", name), tiny_config, bpe_tokenizer, tmp_path, request) as clients:
        for i, adam in enumerate((A, clipped)):
            metrics = step(clients, data, adam)
            assert_stepped_with(clients[0], adam, metrics[0]["grad_norm:mean"])
            assert metrics[1]["loss:sum"] == pytest.approx(metrics[0]["loss:sum"], rel=1e-5)
            assert metrics[1]["grad_norm:mean"] == pytest.approx(metrics[0]["grad_norm:mean"], rel=1e-4)
            assert_same_weights(*map(weights, clients), f"after step {i + 1}")


@pytest.mark.parametrize("name", STRATEGIES)
def test_each_steps_grad_clip_norm_clips_as_on_single(name, tiny_config, bpe_tokenizer, tmp_path, request):
    """``grad_clip_norm`` 0.05, then 0 (no clipping), then 0.5, on strategies built with
    ``gradient_clip_val=1.0``: the gradient norm (~10) is above each clip, so every clip binds, and
    Adam's moments mix the differently scaled gradients: a step clipped to the strategy's 1.0
    instead moves weights by ~lr."""
    data = datums()
    with opened(("single", name), tiny_config, bpe_tokenizer, tmp_path, request) as clients:
        for i, clip in enumerate((0.05, 0.0, 0.5)):
            adam = AdamParams(learning_rate=1e-3, eps=1e-6, grad_clip_norm=clip)
            metrics = step(clients, data, adam)
            assert metrics[0]["grad_norm:mean"] > max(clip, 1.0)  # the norm before clipping
            assert_stepped_with(clients[0], adam, metrics[0]["grad_norm:mean"])
            assert metrics[1]["grad_norm:mean"] == pytest.approx(metrics[0]["grad_norm:mean"], rel=1e-4)
            assert_same_weights(*map(weights, clients), f"after step {i + 1} (clip {clip})")


@pytest.mark.parametrize("name", STRATEGIES)
def test_load_state_with_and_without_the_optimizer_resumes_as_on_single(name, tiny_config, bpe_tokenizer, tmp_path,
                                                                        request):
    """Step, save, step, then ``load_state`` (weights only) and a step, then
    ``load_state_with_optimizer`` and a step: each step after a load equals ``single``'s. The step
    after ``load_state`` is a fresh AdamW's first step, ``-lr * g / (|g| + eps)`` (no weight decay),
    on ``single`` (whose gradients ``g`` are at hand): kept moments or step count give another."""
    data = datums()
    adam = AdamParams(learning_rate=1e-3, beta1=0.5, beta2=0.9, eps=1e-6)
    with opened(("single", name), tiny_config, bpe_tokenizer, tmp_path, request) as clients:
        step(clients, data, adam)
        paths = [c.save_state("one").result() for c in clients]
        saved = weights(clients[0])
        step(clients, data, adam)
        for load in ("load_state", "load_state_with_optimizer"):
            for c, path in zip(clients, paths):
                getattr(c, load)(path).result()
            loaded = [weights(c) for c in clients]
            assert_same_weights(saved, loaded[0], f"{load} on single")
            assert_same_weights(saved, loaded[1], load)
            step(clients, data, adam)
            after = [weights(c) for c in clients]
            assert_same_weights(after[0], after[1], f"the step after {load}")
            if load == "load_state":
                policy = dict(clients[0].strategy.module.policy.named_parameters())
                for n, p in policy.items():
                    fresh = -adam.learning_rate * p.grad / (p.grad.abs() + adam.eps)
                    torch.testing.assert_close(after[0][n] - loaded[0][n], fresh, rtol=1e-4, atol=2e-7,
                                               msg=lambda m, n=n: f"a fresh AdamW's first step, {n}: {m}")

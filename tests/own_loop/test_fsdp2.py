"""The primitives on the fsdp2 strategy (2 ranks, gloo on CPU) against single: the same losses,
log-probs and weights after two steps, within fp32 reduction-order tolerance."""

from __future__ import annotations

import pytest
import torch

from rltrainer.own_loop import AdamParams, Datum, TrainingClient
from rltrainer.strategies import FSDP2Strategy

pytestmark = pytest.mark.usefixtures("warm_ranks")


def datums() -> list[Datum]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (5, 7, 3, 6, 4):  # 5 rows: 3 on one rank, 2 and a padding row on the other
        seq = torch.randint(5, 4000, (n + 1,), generator=g)
        out.append(Datum(seq[:-1], {"target_tokens": seq[1:], "logprobs": -torch.rand(n, generator=g) * 8,
                                    "advantages": torch.randn(n, generator=g)}))
    return out


def test_fsdp2_takes_the_same_steps_as_single(tiny_config, bpe_tokenizer, tmp_path, ray_session):
    data = datums()
    adam = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
    single = TrainingClient(tiny_config, bpe_tokenizer, strategy="single", device="cpu", root=tmp_path / "s")
    with TrainingClient(tiny_config, bpe_tokenizer, strategy=FSDP2Strategy(devices=2, gradient_clip_val=1.0),
                        root=tmp_path / "f") as fsdp:
        for _ in range(2):
            outs = [c.forward_backward(data, "ppo").result() for c in (single, fsdp)]
            assert outs[1].metrics["loss:sum"] == pytest.approx(outs[0].metrics["loss:sum"], rel=1e-5)
            for a, b in zip(*(o.loss_fn_outputs for o in outs)):
                torch.testing.assert_close(b["logprobs"], a["logprobs"], rtol=0, atol=1e-5)
            steps = [c.optim_step(adam).result() for c in (single, fsdp)]
            assert steps[1].metrics["loss:sum"] == pytest.approx(steps[0].metrics["loss:sum"], rel=1e-5)
        after = dict(fsdp.strategy.export_weights())
        for name, p in single.strategy.module.policy.named_parameters():
            torch.testing.assert_close(after[name], p.detach(), rtol=0, atol=1e-5, msg=name)

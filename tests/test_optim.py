"""rltrainer.optim.adamw: fused AdamW where torch has the kernel, the per-tensor loop elsewhere."""

from __future__ import annotations

import torch

from rltrainer.optim import adamw, fused_supported


def test_fused_on_plain_cpu_parameters_and_the_same_steps_as_the_loop():
    torch.manual_seed(0)
    shapes = [(300, 16), (16,), (7, 5)]
    fused_params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    loop_params = [torch.nn.Parameter(p.detach().clone()) for p in fused_params]
    fused = adamw(fused_params, lr=1e-2, weight_decay=0.1)
    loop = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] is True and not loop.defaults["fused"]
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(fused_params, loop_params):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        fused.step()
        loop.step()
    for a, b in zip(fused_params, loop_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_explicit_choice_wins_and_unsupported_parameters_keep_the_loop():
    p = torch.nn.Parameter(torch.randn(4))
    assert not adamw([p], lr=1e-3, fused=False).defaults["fused"]
    assert adamw([p], lr=1e-3, foreach=True).defaults["foreach"] is True
    assert not fused_supported([])
    assert not fused_supported([torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4, device="meta"))])
    assert not fused_supported([torch.zeros(3, dtype=torch.long)])


def test_grpo_builds_fused_adamw_on_cpu(tiny_config, bpe_tokenizer):
    from rltrainer import GRPO

    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs="gsm8k")
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True

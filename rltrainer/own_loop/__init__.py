"""Your own loop: Tinker's primitives (``forward_backward``, ``optim_step``,
``save_weights_and_get_sampling_client``, ``sample``...) on rltrainer's strategies and engines, in
process (:class:`TrainingClient`) and behind a local server the unchanged ``tinker`` SDK talks to
(:mod:`rltrainer.own_loop.server`, ``rltrainer serve``).

Named ``own_loop``, not ``tinker``, so that ``import tinker`` in a user's loop stays the SDK.

A GRPO loop (every call returns a future; ``.result()`` waits)::

    from rltrainer.own_loop import AdamParams, Datum, SamplingParams, TrainingClient

    client = TrainingClient(model, tokenizer, rank=16)  # LoRA; without rank: every parameter
    for prompts in batches:  # lists of token ids
        sampler = client.save_weights_and_get_sampling_client().result()
        futures = [sampler.sample(p, 8, SamplingParams(max_tokens=64)) for p in prompts]
        datums = []
        for prompt, future in zip(prompts, futures):
            samples = future.result().sequences
            rewards = torch.tensor([reward(s.tokens) for s in samples])
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            for s, a in zip(samples, advantages.tolist()):
                full, n = prompt + s.tokens, len(prompt) - 1
                datums.append(Datum(full[:-1], {"target_tokens": full[1:],
                                                "logprobs": [0.0] * n + s.logprobs,
                                                "advantages": [0.0] * n + [a] * len(s.tokens)}))
        client.forward_backward(datums, "importance_sampling")
        client.optim_step(AdamParams(learning_rate=1e-5))

Strategies: ``"single"``, ``"fsdp2"`` (``TrainingClient(..., strategy=FSDP2Strategy(devices=2))``) and
``"megatron"`` (full-parameter only). Sampling: ``rollout=`` as ``Trainer(rollout=...)`` takes it (default
the ``hf`` engine beside the strategy); ``vllm`` and split placement included.
"""

from rltrainer.own_loop.client import (AdamParams, ForwardBackwardOutput, OptimStepResponse, SampledSequence,
                                       SampleResponse, SamplingClient, SamplingParams, StaleSamplerError,
                                       TrainingClient)
from rltrainer.own_loop.data import Datum
from rltrainer.own_loop.losses import TINKER_LOSSES

__all__ = ["AdamParams", "Datum", "ForwardBackwardOutput", "OptimStepResponse", "SampleResponse", "SampledSequence",
           "SamplingClient", "SamplingParams", "StaleSamplerError", "TINKER_LOSSES",
           "TrainingClient"]

"""Your own loop: Tinker's primitives (``forward_backward``, ``optim_step``,
``save_weights_and_get_sampling_client``, ``sample``...) on rltrainer's strategies and engines, in
process (:class:`TrainingClient`) and behind a local server the unchanged ``tinker`` SDK talks to
(:mod:`rltrainer.own_loop.server`, ``rltrainer serve``).

Named ``own_loop``, not ``tinker``, so that ``import tinker`` in a user's loop stays the SDK.
"""

from rltrainer.own_loop.client import (AdamParams, ForwardBackwardOutput, OptimStepResponse, SampledSequence,
                                       SampleResponse, SamplingClient, SamplingParams, TrainingClient)
from rltrainer.own_loop.data import Datum
from rltrainer.own_loop.losses import TINKER_LOSSES

__all__ = ["AdamParams", "Datum", "ForwardBackwardOutput", "OptimStepResponse", "SampleResponse", "SampledSequence",
           "SamplingClient", "SamplingParams", "TINKER_LOSSES", "TrainingClient"]

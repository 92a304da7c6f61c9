"""Causal LMs: building them (:mod:`~rltrainer.models.build`: a hub id, a path, a config or a
callable, frozen copies, the deferred build of sharded strategies), their safetensors files read
and written tensor by tensor (:mod:`~rltrainer.models.safetensors_io`) in the form the hub stores
(:mod:`~rltrainer.models.checkpoint_form`: MoE experts one by one), and the teacher-forced
forward over response tokens (:mod:`~rltrainer.models.log_probs`: per-token log-probs and
entropies), what the trainer checks on a model (:mod:`~rltrainer.models.support`), a
mixture-of-experts model's routers, routing replay and routing metrics (:mod:`~rltrainer.models.moe`),
and the hub's checkpoint form of fused tensors (:mod:`~rltrainer.models.checkpoint_form`)."""

from rltrainer.models.build import (ModelSpec, RandomInit, build_causal_lm, deferred_init, freeze, frozen_copy,
                                    init_from_config, load_pretrained, parameter_aliases, persistent_buffers,
                                    share_rng_state, source_key, state_tensors, take_weight_source)
from rltrainer.models.log_probs import (entropy_from_log_softmax, pad_columns, response_log_probs,
                                        token_log_probs, trim_padding_columns)
from rltrainer.models.safetensors_io import SafetensorsWeights, write_safetensors
from rltrainer.models.support import chunkable_head

__all__ = ["ModelSpec", "RandomInit", "SafetensorsWeights", "build_causal_lm", "chunkable_head", "deferred_init",
           "entropy_from_log_softmax", "freeze", "frozen_copy", "init_from_config", "load_pretrained",
           "pad_columns", "parameter_aliases", "persistent_buffers", "response_log_probs", "share_rng_state",
           "source_key", "state_tensors", "take_weight_source", "token_log_probs", "trim_padding_columns",
           "write_safetensors"]

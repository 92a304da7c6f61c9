"""``strategy="megatron"``: training on megatron-core (written against megatron-core 0.16) with
tensor, pipeline and data parallelism, and for a mixture of experts expert parallelism; ranks are
Ray actors (one in-process worker for a single rank).

Each rank runs the module's ``configure_model`` (transformers: Llama, Qwen2, Qwen3, or the
mixtures of experts Qwen3-MoE and Mixtral) on the meta device
(:func:`~rltrainer.models.deferred_init`: no rank holds a whole transformers model);
:func:`~rltrainer.strategies.megatron.config.megatron_config` refuses any config field it cannot
convert exactly, on every rank, before anything is built. Each rank then builds its own
megatron-core ``GPTModel`` shard (its pipeline stage, its tensor-parallel slice) and fills it with
:func:`~rltrainer.strategies.megatron.layouts.megatron_shard`: from a checkpoint's safetensors
files it reads only its stage's tensors, and of the row-split ones only its rows (``o_proj`` and
``down_proj``, split by columns, are read whole, one at a time; of the fused expert tensors its
experts' rows); a random init runs on rank 0 alone, which sends each rank its shard one tensor at
a time. The reference model and a critic
from a config load the same way; a model ``configure_model`` builds in full (a callable spec, a
critic from a checkpoint path) is converted as it is. Each rank's model is swapped into the module
behind :class:`MegatronCausalLM`, which answers the transformers call the hooks make
(``model(input_ids, attention_mask, position_ids, logits_to_keep)``) with full-vocabulary logits.
So ``policy_step`` and ``compute_step`` run unchanged: changing FSDP2 to Megatron touches no
algorithm. Weights leave in HF names (:func:`megatron_to_hf`), so any engine takes them. A mixture
of experts runs megatron-core's MoE layer, its experts split over ``expert_model_parallel_size``
data-parallel ranks, and replays given routes through megatron's router (``routed_experts``, see
:class:`~rltrainer.strategies.megatron.routing.RouteReplay`; its routers fill the ``moe/*``
metrics and load-balancing loss of the ``Routing`` part as transformers' do).

The hooks run inside megatron-core's forward-backward schedule (``get_forward_backward_func``:
no pipelining at ``pipeline_model_parallel_size=1``, 1F1B otherwise). On the last stage a hook
runs whole and its loss (or its outputs) is the schedule's; on an earlier stage the model call
inside the hook raises :class:`StageOutput`, whose hidden states the schedule sends on (see
:class:`PipelineSlot`). So with pipeline stages a hook may call one pipelined model per
micro-batch (PPO's critic needs ``pipeline_model_parallel_size=1``).

Gradients and the optimizer step are megatron-core's own, as its users expect
(:mod:`~rltrainer.strategies.megatron.optimizer`): each trainable model is wrapped in megatron's
``DistributedDataParallel`` (contiguous buckets; no reduction before the schedule's last
micro-batch, then megatron's ``finalize_model_grads``: the bucketed reduce-scatter, or all-reduce,
over the data-parallel group and the tied embedding's all-reduce between the first and last
stage). Gradients are summed over data-parallel ranks, not averaged (``calculate_per_token_loss``:
the hooks' losses are normalised by global counts). The optimizers ``configure_optimizers()``
returns (AdamW / Adam; SGD with ``use_distributed_optimizer=False``) become one megatron-core
optimizer (``get_megatron_optimizer``), by default the distributed one (each data-parallel rank
steps its shard, then the updated parameters are all-gathered), with each param group's lr, betas,
eps and weight decay; the user's LR schedulers step its groups. The gradient norm (``actor/grad_norm``)
and clipping are megatron's (over data-parallel shards, tensor-parallel slices and pipeline stages).
On CPU (tests), the attention is a layer spec of our own (SDPA) and megatron-core's CUDA
placements and type names point at the CPU: see
:func:`~rltrainer.strategies.megatron.cpu.cpu_shims` and
:func:`~rltrainer.strategies.megatron.cpu.cpu_placement`.

Weights leave one bucket at a time: the stage holding a bucket's tensors gathers their
tensor-parallel shards, converts just those, and broadcasts them over its pipeline group; only
parameters an optimizer step changed are sent.

Where each job lives:

- :mod:`~rltrainer.strategies.megatron.strategy`: :class:`MegatronStrategy`, the controller side.
- :mod:`~rltrainer.strategies.megatron.worker`: :class:`MegatronWorker`, the rank side (setup,
  the schedule, weight export, checkpoints).
- :mod:`~rltrainer.strategies.megatron.checkpoint`: checkpoints any layout loads (HF names, whole tensors).
- :mod:`~rltrainer.strategies.megatron.optimizer`: megatron's DDP and optimizer, built from the
  module's optimizers (:class:`~rltrainer.strategies.megatron.optimizer.MegatronOptimizer`).
- :mod:`~rltrainer.strategies.megatron.config`: a transformers config -> megatron-core settings, or an error.
- :mod:`~rltrainer.strategies.megatron.models`: ``GPTModel`` behind the transformers call.
- :mod:`~rltrainer.strategies.megatron.layouts`: HF <-> megatron weight layouts (pure tensors).
- :mod:`~rltrainer.strategies.megatron.routing`: a mixture of experts' routers: replay and record.
- :mod:`~rltrainer.strategies.megatron.cpu`: the shims that run megatron-core on CPU ranks.

megatron-core itself is imported only inside functions: importing this package needs none of it.
"""

from rltrainer.strategies.megatron.strategy import MegatronStrategy
from rltrainer.strategies.megatron.worker import MegatronWorker

__all__ = ["MegatronStrategy", "MegatronWorker"]

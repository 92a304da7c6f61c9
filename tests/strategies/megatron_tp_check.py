"""megatron-core on CPU: a Qwen2-architecture GPTModel with tensor parallelism 2 over gloo, its
weights converted from a transformers model by ``hf_to_megatron``; prints (as JSON) how far its
logits, loss and gradients (converted back by ``megatron_to_hf``) are from the single-device
transformers model's. Run by tests/strategies/test_megatron_cpu.py; runnable alone:

    python tests/strategies/megatron_tp_check.py

Two things stand between megatron-core 0.16 and a CPU, both handled here and nowhere else:
its attention (``DotProductAttention``) draws a global CUDA memory buffer and a CUDA RNG state,
so the layer spec swaps in :class:`CPUAttention` (scaled-dot-product attention, causal, grouped
queries); and RoPE and a few buffers place tensors with ``torch.cuda.current_device()``, which
is pointed at the CPU in these worker processes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

VOCAB, HIDDEN, LAYERS, HEADS, GROUPS, FFN, SEQ, BATCH = 128, 64, 2, 8, 2, 96, 12, 3


def hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=GROUPS, tie_word_embeddings=True,
                       rope_theta=10000.0, rms_norm_eps=1e-6)


def cpu_attention_class():
    from megatron.core import parallel_state
    from megatron.core.transformer.module import MegatronModule

    class CPUAttention(MegatronModule):
        """``core_attention`` for CPU: causal SDPA over this rank's heads (GQA by repetition)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            tp = parallel_state.get_tensor_model_parallel_world_size()
            self.heads, self.groups = config.num_attention_heads // tp, config.num_query_groups // tp

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            sq, b = query.shape[:2]  # [sq, b, heads, d] -> [b, heads, sq, d]
            q = query.permute(1, 2, 0, 3)
            k = key.permute(1, 2, 0, 3).repeat_interleave(self.heads // self.groups, dim=1)
            v = value.permute(1, 2, 0, 3).repeat_interleave(self.heads // self.groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    return CPUAttention


def megatron_model(tp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, ffn_hidden_size=FFN, gated_linear_unit=True,
                               activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=1e-6,
                               add_bias_linear=False, add_qkv_bias=True, use_cpu_initialization=True,
                               params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                               tensor_model_parallel_size=tp)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = cpu_attention_class()
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=True)


def rank_main(rank: int, world: int, port: int, workdir: str) -> None:
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: torch.device("cpu")  # megatron-core places some buffers "on CUDA"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rltrainer.strategies.megatron.layouts import MegatronLayout, hf_to_megatron, megatron_to_hf

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    data = torch.load(os.path.join(workdir, "inputs.pt"))
    layout = MegatronLayout(tp=world)
    shards = hf_to_megatron(data["state"], hf_config(), layout)
    model = megatron_model(world)
    missing, unexpected = model.load_state_dict(shards[0][rank], strict=False)
    missing = [m for m in missing if not m.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    ids = data["ids"]
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    logits = gather_from_tensor_model_parallel_region(model(ids, positions, attention_mask=None))  # [b, s, V]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    gathered = [None] * world
    dist.all_gather_object(gathered, grads)
    if rank == 0:
        grad_shards = [[{n: g[n] for n in g} for g in gathered]]
        torch.save({"logits": logits.detach(), "loss": loss.detach(),
                    "grads": megatron_to_hf(grad_shards, hf_config(), layout)}, os.path.join(workdir, "tp.pt"))
    dist.destroy_process_group()


def main() -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(hf_config(), attn_implementation="sdpa")
    with torch.no_grad():
        for p in reference.parameters():  # non-trivial norms and biases
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    logits = reference(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    with tempfile.TemporaryDirectory() as workdir:
        torch.save({"state": {n: p.detach() for n, p in reference.named_parameters()}, "ids": ids},
                   os.path.join(workdir, "inputs.pt"))
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port, workdir), nprocs=2)
        tp = torch.load(os.path.join(workdir, "tp.pt"))
    grad_diff = max((tp["grads"][n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    print(json.dumps({"logits_max_abs_diff": (tp["logits"] - logits.detach()).abs().max().item(),
                      "loss_tp2": tp["loss"].item(), "loss_hf": loss.item(), "grad_max_abs_diff": grad_diff,
                      "grad_names": len(tp["grads"])}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

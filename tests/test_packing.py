"""Padding-free micro-batches (rltrainer/packing.py): the rows packed into one sequence give the
padded path's log-probs, entropies, values and loss gradients within fp32 rounding, for Qwen2,
Qwen3, Llama and a LoRA policy, with the chunked LM head and with full logits, on one device,
through the ``single`` strategy's stages and update, and on 2 FSDP2 ranks; the setting reaches
the micro-batches (token budget in real tokens) and megatron refuses it.

Tolerances: the packed forward runs the same fp32 products over fewer, differently laid out rows
(one sequence, a block-diagonal mask); observed differences are ~5e-7 on log-probs and ~1e-6 on
gradients. 1e-5 / 1e-4 (relative) leave room on any CPU's kernels, far below a wrong token or
position (a position shifted by one moves log-probs by > 1e-2)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from rltrainer import GRPO, Trainer
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import build_causal_lm, response_log_probs
from rltrainer.modules.ppo import build_value_model, response_values
from rltrainer.packing import pack_rows
from rltrainer.strategies import SingleDeviceStrategy
from rltrainer.strategies.dispatch import partition_for_ranks
from rltrainer.testing import length_reward, prepared_batch, tiny_qwen2_config, tiny_qwen3_config

VOCAB, P, T, ROWS = 300, 7, 9, 4


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, use_cache=False)


CONFIGS = {"qwen2": lambda: tiny_qwen2_config(VOCAB, hidden_size=32),
           "qwen3": lambda: tiny_qwen3_config(VOCAB, hidden_size=32, tie_word_embeddings=False),
           "llama": llama_config}


def make_batch(seed: int = 0) -> RolloutBatch:
    """Rows with left-padded prompts and right-padded responses of varied lengths (row 3 unpadded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (ROWS, P + T), generator=g)
    mask = torch.ones_like(ids)
    for row, (prompt, response) in enumerate([(3, 9), (7, 2), (1, 5), (7, 9)]):
        mask[row, : P - prompt] = 0
        mask[row, P + response:] = 0
    ids = ids * mask
    return RolloutBatch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                         "responses": ids[:, P:], "response_mask": mask[:, P:].clone()})


def outputs_and_grads(model, batch, padding_free, chunk_tokens=None, temperature=0.7):
    mask = batch["response_mask"].float()
    log_probs, entropy = response_log_probs(model, batch, temperature, with_entropy=True, entropy_grad=True,
                                            chunk_tokens=chunk_tokens, padding_free=padding_free)
    weights = torch.linspace(-1, 1, log_probs.numel()).view_as(log_probs) * mask
    loss = (log_probs * weights).sum() + 0.3 * (entropy * weights.flip(-1) * mask).sum()
    model.zero_grad()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach() * mask, entropy.detach() * mask, grads


def assert_same(packed, padded):
    torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1], padded[1], atol=1e-5, rtol=1e-5)
    assert packed[2].keys() == padded[2].keys()
    for name in padded[2]:
        torch.testing.assert_close(packed[2][name], padded[2][name], atol=1e-6, rtol=1e-4, msg=name)


def test_pack_rows_drops_padding_and_restarts_positions():
    batch = make_batch()
    packed = pack_rows(batch, T, varlen=True)
    lengths = batch["attention_mask"].sum(1)  # 12, 9, 6, 16
    assert packed.inputs["input_ids"].shape == (1, int(lengths.sum())) and packed.inputs["attention_mask"] is None
    starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    assert packed.inputs["cu_seq_lens_q"].tolist() == starts.tolist()
    assert packed.inputs["position_ids"][0, starts[:-1]].tolist() == [0, 0, 0, 0]
    assert packed.inputs["max_length_q"] == 16
    assert len(packed.predictors) == int(batch["response_mask"].sum())  # one per real response token
    flat = packed.inputs["input_ids"][0]
    torch.testing.assert_close(flat[packed.predictors + 1], batch["responses"][packed.rows, packed.cols])
    assert "cu_seq_lens_q" not in pack_rows(batch, T).inputs  # sdpa / eager read the restarts


def test_position_ids_that_do_not_restart_are_refused():
    batch = make_batch()
    batch["position_ids"] = batch["position_ids"] + 1
    with pytest.raises(ValueError, match="position_ids restarting at 0"):
        pack_rows(batch, T)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("chunk_tokens", [None, 0], ids=["chunked_head", "full_logits"])
def test_packed_log_probs_entropy_and_gradients_equal_padded(family, chunk_tokens):
    model = build_causal_lm(CONFIGS[family](), seed=0)
    batch = make_batch()
    padded = outputs_and_grads(model, batch, False, chunk_tokens=0)
    packed = outputs_and_grads(model, batch, True, chunk_tokens=chunk_tokens)
    assert_same(packed, padded)
    assert "forward" not in model.get_output_embeddings().__dict__  # the head is restored
    assert (packed[0][batch["response_mask"] == 0] == 0).all()


def test_eager_attention_and_no_temperature():
    config = tiny_qwen2_config(VOCAB, hidden_size=32)
    config._attn_implementation = "eager"
    model = build_causal_lm(config, seed=0)
    batch = make_batch(1)
    assert_same(outputs_and_grads(model, batch, True, chunk_tokens=4, temperature=1.0),
                outputs_and_grads(model, batch, False, chunk_tokens=0, temperature=1.0))


def test_a_lora_policy_packs_too():
    """peft's wrapper passes the packed inputs through; its LoRA-wrapped head takes the full-logits path."""
    from peft import LoraConfig, get_peft_model

    model = build_causal_lm(CONFIGS["qwen2"](), seed=0)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"],
                                             init_lora_weights=False))
    batch = make_batch()

    def trainable(result):
        return result[0], result[1], {n: g for n, g in result[2].items() if "lora_" in n}

    assert_same(trainable(outputs_and_grads(model, batch, True)),
                trainable(outputs_and_grads(model, batch, False, chunk_tokens=0)))


def test_the_batch_field_turns_it_on():
    model = build_causal_lm(CONFIGS["qwen2"](), seed=0)
    batch = make_batch()
    batch.padding_free = True
    with torch.no_grad():
        marked = response_log_probs(model, batch)[0]
        explicit = response_log_probs(model, batch, padding_free=True)[0]
    assert torch.equal(marked, explicit)
    assert (marked[batch["response_mask"] == 0] == 0).all()  # the padded path leaves values there


def test_packed_values_and_gradients_equal_padded():
    critic = build_value_model(tiny_qwen2_config(VOCAB, hidden_size=32), seed=0)
    batch = make_batch()
    mask = batch["response_mask"].float()
    results = []
    for padding_free in (False, True):
        values = response_values(critic, batch, padding_free=padding_free) * mask
        critic.zero_grad()
        (values * torch.linspace(-1, 1, values.numel()).view_as(values)).sum().backward()
        results.append((values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_token_budget_counts_real_tokens_when_packed():
    batch = make_batch()  # rows of 12, 9, 6 and 16 real tokens, 16 wide
    assert [len(p) for p in batch.split_by_tokens(32)] == [2, 2]  # 2 rows x 16 columns each
    assert [len(p) for p in batch.split_by_tokens(32, packed=True)] == [3, 1]  # 12 + 9 + 6 = 27


def test_micro_batches_are_marked_on_every_path():
    batch = make_batch()
    strategy = SingleDeviceStrategy(device="cpu", max_tokens_per_micro_batch=32, padding_free=True)
    parts = strategy.micro_batches(batch)
    assert [len(p) for p in parts] == [3, 1] and all(p.padding_free for p in parts)
    assert not batch.padding_free
    ranks, _ = partition_for_ranks(batch[[0, 1, 2]], 2, micro_batch_size=1, max_tokens=None, padding_free=True)
    assert all(mb.padding_free for part in ranks for mb in part)
    assert any(mb.padding for part in ranks for mb in part)  # the padding micro-batch too
    assert not any(mb.padding_free for mb in SingleDeviceStrategy(device="cpu").micro_batches(batch))


def test_the_setting_reaches_the_strategy_and_bad_values_or_megatron_are_refused():
    assert Trainer(strategy=SingleDeviceStrategy(padding_free=True), logger=False,
                   enable_progress_bar=False).strategy.padding_free
    assert not Trainer(logger=False, enable_progress_bar=False).strategy.padding_free
    with pytest.raises(ValueError, match="padding_free must be True"):
        SingleDeviceStrategy(padding_free="yes")
    from rltrainer.strategies import MegatronStrategy

    with pytest.raises(ValueError, match="megatron.*padded micro-batches only"):
        MegatronStrategy(padding_free=True)


def with_short_responses(batch: RolloutBatch, lengths: list[int], pad_id: int) -> RolloutBatch:
    """``batch`` with row ``i``'s response cut to ``lengths[i]`` tokens (a random model rarely
    stops early), the masks and positions following."""
    batch = batch.copy()
    keep = torch.arange(batch["responses"].shape[1])[None] < torch.tensor(lengths)[:, None]  # [N, T]
    responses = batch["responses"].masked_fill(~keep, pad_id)
    attention = torch.cat([batch["attention_mask"][:, : -keep.shape[1]], keep.long()], 1)
    batch["responses"], batch["response_mask"], batch["attention_mask"] = responses, keep.long(), attention
    batch["input_ids"] = torch.cat([batch["input_ids"][:, : -keep.shape[1]], responses], 1)
    batch["position_ids"] = (attention.cumsum(-1) - 1).clamp(min=0)
    batch.global_tokens, batch.global_rows = float(keep.sum()), float(len(batch))
    return batch


def test_single_strategy_stages_and_update_equal_padded(tiny_config, bpe_tokenizer, gsm8k_prompts):
    """The ``old_log_prob`` and ``ref`` stages and one update (two optimizer steps) through the
    ``single`` strategy: the same stage outputs, metrics and updated weights as padded micro-batches."""
    def module():
        return GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=3, max_new_tokens=8,
                    lr=1e-3, kl_coef=0.01, entropy_coef=0.01, update_epochs=2)

    first = module()
    strategy = SingleDeviceStrategy(device="cpu")
    strategy.setup(first, seed=5)
    torch.manual_seed(0)
    rollout = prepared_batch(first, strategy, RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(2)]))
    rollout = with_short_responses(rollout.select("prompts", "responses", "response_mask", "input_ids",
                                                  "attention_mask", "position_ids", "scores", "uid"),
                                   [3, 8, 5, 1, 8, 6], bpe_tokenizer.pad_token_id)
    assert (rollout["attention_mask"][:, 0] == 0).any()  # left-padded prompts too
    results = []
    for padding_free in (False, True):
        m = module()
        strategy = SingleDeviceStrategy(device="cpu", micro_batch_size=4, padding_free=padding_free)
        strategy.setup(m, seed=5)
        batch = rollout
        for stage in m.compute_stages():
            batch = batch.union(strategy.compute(batch, stage))
        batch = m.advantage_step(batch)
        metrics = strategy.train_step(batch)
        results.append((batch, metrics, {n: p.detach().clone() for n, p in m.policy.named_parameters()}))
    (padded, m_padded, w_padded), (packed, m_packed, w_packed) = results
    mask = padded["response_mask"].bool()
    for key in ("old_log_probs", "ref_log_probs"):
        torch.testing.assert_close(packed[key][mask], padded[key][mask], atol=1e-5, rtol=1e-5, msg=key)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert m_packed[key] == pytest.approx(m_padded[key], rel=1e-4, abs=1e-6), key
    for name, w in w_padded.items():
        torch.testing.assert_close(w_packed[name], w, atol=1e-5, rtol=0, msg=name)


def _fsdp2_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rltrainer.strategies.fsdp2.sharding import shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = build_causal_lm(CONFIGS["qwen2"](), seed=0)
    shard_model(model, init_device_mesh("cpu", (2,)), "32-true", cpu_offload=False, reshard_after_forward=True)
    log_probs, entropy, grads = outputs_and_grads(model, make_batch(), True)
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    if rank == 0:
        torch.save((log_probs, entropy, grads), out)
    dist.barrier()  # both ranks done before either tears down (rank 0 holds the store)
    dist.destroy_process_group()


def test_fsdp2_packed_equals_one_device_padded(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp_path, "rank0.pt")
    mp.spawn(_fsdp2_rank, args=(port, out), nprocs=2)
    log_probs, entropy, grads = torch.load(out)
    padded = outputs_and_grads(build_causal_lm(CONFIGS["qwen2"](), seed=0), make_batch(), False, chunk_tokens=0)
    # both ranks ran the batch; shard_model sums gradients over ranks
    assert_same((log_probs, entropy, {n: g / 2 for n, g in grads.items()}), padded)


def widened(batch: RolloutBatch, left: int, right: int) -> RolloutBatch:
    """``batch`` with ``left`` all-padding prompt columns and ``right`` all-padding response columns added."""
    def pad(x, lo, hi):
        return torch.nn.functional.pad(x, (lo, hi))
    mask = pad(batch["attention_mask"], left, right)
    ids = pad(batch["input_ids"], left, right)
    return RolloutBatch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                         "responses": pad(batch["responses"], 0, right),
                         "response_mask": pad(batch["response_mask"], 0, right)})


@pytest.mark.parametrize("chunk_tokens", [None, 0])
def test_padded_path_leaves_out_columns_that_are_padding_in_every_row(chunk_tokens):
    """The padded path runs only the columns some row of the micro-batch needs: a micro-batch
    widened by all-padding columns (as when a step's longest prompt or response is in another
    micro-batch) gives the same log-probs, entropies and gradients, and 0 in the added columns;
    two rows alone give what they give inside the whole batch."""
    from rltrainer.models import trim_padding_columns

    model = build_causal_lm(CONFIGS["qwen2"](), seed=0)
    batch = make_batch()
    wide = widened(batch, left=3, right=4)
    inputs, kept = trim_padding_columns({k: wide[k] for k in ("input_ids", "attention_mask", "position_ids")}, T + 4)
    assert kept == T and inputs["input_ids"].shape[1] == P + T  # row 3 spans the original columns
    tight = outputs_and_grads(model, batch, padding_free=False, chunk_tokens=chunk_tokens)
    log_probs, entropy = response_log_probs(model, wide, 0.7, with_entropy=True, entropy_grad=True,
                                            chunk_tokens=chunk_tokens)
    mask = batch["response_mask"].float()
    weights = torch.linspace(-1, 1, mask.numel()).view_as(mask) * mask  # as outputs_and_grads weighs [ROWS, T]
    loss = (log_probs[:, :T] * weights).sum() + 0.3 * (entropy[:, :T] * weights.flip(-1) * mask).sum()
    model.zero_grad()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_same((log_probs[:, :T].detach() * mask, entropy[:, :T].detach() * mask, grads), tight)
    log_probs, entropy = response_log_probs(model, wide, 0.7, with_entropy=True, chunk_tokens=chunk_tokens)
    assert log_probs.shape == (ROWS, T + 4) and not log_probs[:, T:].any() and not entropy[:, T:].any()

    pair = batch[1:3]  # prompts of 7 and 1 tokens, responses of 2 and 5: 2 response columns of 9 left out
    _, pair_kept = trim_padding_columns({k: pair[k] for k in ("input_ids", "attention_mask", "position_ids")}, T)
    assert pair_kept == 5
    with torch.no_grad():
        alone = response_log_probs(model, pair, 0.7, chunk_tokens=chunk_tokens)[0] * pair["response_mask"]
        inside = response_log_probs(model, batch, 0.7, chunk_tokens=chunk_tokens)[0][1:3] * pair["response_mask"]
    torch.testing.assert_close(alone, inside, atol=1e-5, rtol=1e-5)


def test_values_leave_out_all_padding_columns_too():
    critic = build_value_model(CONFIGS["qwen2"](), seed=0)
    batch = make_batch()
    with torch.no_grad():
        tight = response_values(critic, batch, padding_free=False) * batch["response_mask"]
        wide = response_values(critic, widened(batch, left=2, right=3), padding_free=False)
    assert wide.shape == (ROWS, T + 3) and not wide[:, T:].any()
    torch.testing.assert_close(wide[:, :T] * batch["response_mask"], tight, atol=1e-5, rtol=1e-5)

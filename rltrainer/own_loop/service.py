"""The state behind ``rltrainer serve`` (:mod:`rltrainer.own_loop.server`, the HTTP side): what
the tinker SDK's calls do, on the in-process primitives (:class:`~rltrainer.own_loop.TrainingClient`
per training run, :class:`~rltrainer.own_loop.client.SamplingClient` per sampler), their futures,
checkpoints and sessions (:mod:`rltrainer.own_loop.records`), and the SDK's protobuf results.

:class:`LocalTinker` takes each endpoint's decoded request and returns its JSON answer (or
protobuf bytes), so the HTTP handler only routes; the wire protocol is described in
:mod:`rltrainer.own_loop.server`.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rltrainer.own_loop.client import AdamParams, SamplingClient, SamplingParams, TrainingClient
from rltrainer.own_loop.data import Datum
from rltrainer.own_loop.records import Checkpoint, Session, now, search, ttl

log = logging.getLogger(__name__)

PREFIX = "/api/v1"  # every endpoint's path starts with it
LONG_POLL_S = 30.0  # under the SDK's 45 s timeout on retrieve_future
#: How long a call waits for the ones numbered before it. The SDK sends a client's calls one after
#: another (each once the previous one was accepted), so only the chunks of one large
#: ``forward_backward`` arrive out of order, within milliseconds; a number that never comes (a call
#: the SDK failed before sending, or one this server does not serve) must not stall the next ones.
SEQ_WAIT_S = 2.0


def sdk_tokenizer_name(source: str | Path) -> str | None:
    """``source`` (a tokenizer's folder, or a hub id) spelled as a ``base_model`` name from which the
    SDK loads that tokenizer; ``None`` where no spelling does.

    ``SamplingClient.get_tokenizer`` loads ``AutoTokenizer.from_pretrained`` of the sampler's base
    model name and ignores the server's ``tokenizer_id`` (tinker 0.38
    ``lib/public_interfaces/sampling_client.py:722-728``); on the way it cuts the name at its first
    ``:`` (``:896``) and reads a name with exactly two ``/`` as ``org/model/variant``, loading
    ``org/model`` (``:905-910``). So a folder is named by its absolute path, with a trailing ``/``
    where it has exactly two (``/work/tok`` would load ``/work``), and a path with a ``:`` cannot
    be named. A hub id is its own name: the SDK looks it up on the hub as the server did.
    """
    if not Path(source).is_dir():
        return str(source)
    path = str(Path(source).resolve())
    if ":" in path:
        return None
    return path + "/" if path.count("/") == 2 else path


def default_name(model: Any, tokenizer_id: str | None) -> str:
    """The served name where none is given: the tokenizer's (``tokenizer_id``, else a ``model`` given
    by name or folder) as :func:`sdk_tokenizer_name` spells it, else ``rltrainer/local``."""
    source = tokenizer_id if tokenizer_id is not None else model if isinstance(model, (str, Path)) else None
    name = sdk_tokenizer_name(source) if source is not None else None
    return name or "rltrainer/local"


def proto() -> Any:
    """The SDK's protobuf module; a clear error without the SDK."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:
        raise ImportError("The local Tinker server speaks the tinker SDK's protobuf messages: "
                          "pip install tinker==0.38.0 (Apache-2.0), or pip install -e '.[serve]'") from e
    return tinker_public_pb2


@dataclass
class Model:
    """One training client of a session, and the order its calls run in."""

    client: Future  # of a TrainingClient
    base_model: str
    rank: int | None
    next_seq: int = 1
    turn: threading.Condition = field(default_factory=threading.Condition)
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)  # by checkpoint_id ("weights/<name>", ...)


class LocalTinker:
    """The server's state: models by id, sampling sessions, futures. ``model``/``tokenizer``: what
    every ``base_model`` request trains, served under ``name`` (default :func:`default_name`: the
    tokenizer's folder, so that both of the SDK's ``get_tokenizer`` load it offline);
    ``tokenizer_id``: the local folder (or hub id) the SDK's ``TrainingClient.get_tokenizer`` loads;
    ``full``: train every parameter for a LoRA request; ``strategy_kwargs``: the Strategy's (default
    ``single`` on CPU)."""

    def __init__(self, model: Any, tokenizer: Any, *, name: str | None = None, tokenizer_id: str | None = None,
                 root: str | Path | None = None, full: bool = False, **strategy_kwargs: Any) -> None:
        self.pb = proto()
        name = name if name is not None else default_name(model, tokenizer_id)
        self.model, self.tokenizer, self.name, self.tokenizer_id = model, tokenizer, name, tokenizer_id
        self.full, self.strategy_kwargs = full, strategy_kwargs or {"strategy": "single", "device": "cpu"}
        self.root = Path(root) if root is not None else None
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Future] = {}  # sampling session id -> Future[SamplingClient]
        self.gone: dict[str, str] = {}  # tinker path of a deleted or expired checkpoint -> how it went
        self.futures: dict[str, tuple[Future, Any]] = {}  # request id -> (future, encode(result))
        self.lock = threading.Lock()
        self._builder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rltrainer-serve")

    # -- futures --------------------------------------------------------------------------------
    def future(self, fut: Future, encode: Any = None, **extra: Any) -> dict[str, Any]:
        request_id = uuid.uuid4().hex
        with self.lock:
            self.futures[request_id] = (fut, encode)
        return {"request_id": request_id, **extra}

    def failed(self, error: Exception) -> dict[str, Any]:
        fut: Future = Future()
        fut.set_exception(error)
        return self.future(fut)

    def retrieve(self, request_id: str) -> tuple[int, bytes | dict[str, Any], str]:
        """(status, body, content type) for one poll."""
        with self.lock:
            entry = self.futures.get(request_id)
        if entry is None:
            return 404, {"detail": f"unknown request_id {request_id!r}"}, "json"
        fut, encode = entry
        try:
            result = fut.result(timeout=LONG_POLL_S)
        except TimeoutError:
            return 200, {"type": "try_again", "request_id": request_id, "queue_state": "active"}, "json"
        except Exception as e:  # noqa: BLE001 - the SDK shows it as RequestFailedError
            log.warning("request %s failed: %s", request_id, e, exc_info=e)
            return 200, {"error": f"{type(e).__name__}: {e}", "category": "user"}, "json"
        body = encode(result) if encode is not None else result
        return 200, body, "proto" if isinstance(body, bytes) else "json"

    # -- models ---------------------------------------------------------------------------------
    def create_model(self, j: dict[str, Any]) -> dict[str, Any]:
        model_id = f"{j['session_id']}:train:{j['model_seq_id']}"  # the SDK derives it so itself
        try:
            self.check_name(j.get("base_model"))
        except ValueError as e:
            return self.failed(e)
        rank = None if self.full else (j.get("lora_config") or {}).get("rank")
        seed = (j.get("lora_config") or {}).get("seed") or 0
        client = self._builder.submit(self._new_client, model_id, rank, seed)
        with self.lock:
            self.models[model_id] = Model(client, self.name, rank)
        return self.future(client, lambda _: {"model_id": model_id, "type": "create_model"}, model_id=model_id)

    def check_name(self, base_model: Any) -> None:
        """Refuse a ``base_model`` other than the served name (or a folder spelling of the same folder)."""
        if base_model == self.name:
            return
        if isinstance(base_model, str) and Path(base_model).is_dir() and Path(self.name).is_dir() \
                and Path(base_model).resolve() == Path(self.name).resolve():
            return
        raise ValueError(f"This server trains {self.name!r} (rltrainer serve --name); got base_model={base_model!r}")

    def info(self, model_id: str) -> dict[str, Any]:
        m = self.models[model_id]
        return {"type": "get_info", "model_id": model_id, "model_name": m.base_model, "is_lora": m.rank is not None,
                "lora_rank": m.rank, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": "rltrainer", "model_name": m.base_model, "tokenizer_id": self.tokenizer_id}}

    def in_turn(self, model_id: str, seq_id: int | None, call: Any) -> dict[str, Any]:
        """Submit ``call(client) -> (future, encode)`` when the calls before ``seq_id`` are submitted."""
        m = self.models.get(model_id)
        if m is None:
            return self.failed(KeyError(f"no training client {model_id!r} on this server"))
        client: TrainingClient = m.client.result()
        with m.turn:
            if seq_id is not None and not m.turn.wait_for(lambda: m.next_seq >= seq_id, timeout=SEQ_WAIT_S):
                log.debug("%s: call %s runs without call %s (not sent to this server)", model_id, seq_id, m.next_seq)
            try:
                fut, encode = call(client, m)
            except Exception as e:  # noqa: BLE001 - bad input: the future carries it
                fut, encode = None, e
            if seq_id is not None:
                m.next_seq = max(m.next_seq, seq_id + 1)
                m.turn.notify_all()
        return self.failed(encode) if fut is None else self.future(fut, encode, model_id=model_id)

    def skip_turn(self, j: dict[str, Any]) -> None:
        """A call with a turn that this server does not serve: the next may go."""
        m = self.models.get(j.get("model_id", "")) if isinstance(j, dict) else None
        if m is not None and isinstance(j.get("seq_id"), int):
            with m.turn:
                m.next_seq = max(m.next_seq, j["seq_id"] + 1)
                m.turn.notify_all()

    def forward_backward(self, body: bytes) -> dict[str, Any]:
        req = self.pb.ForwardBackwardRequest()
        req.ParseFromString(body)
        datums = [Datum(self._tokens(d.model_input), {k: self._tensor(t) for k, t in d.loss_fn_inputs.items()})
                  for d in req.data]
        config = dict(req.loss_fn_config) or None
        if req.loss_fn == "custom":
            return self.failed(ValueError("server-side custom losses are off (custom_loss_server_side false): "
                                          "forward_backward_custom runs the loss in the client"))

        def call(client: TrainingClient, m: Model) -> tuple[Future, Any]:
            method = client.forward if req.forward_only else client.forward_backward
            return method(datums, req.loss_fn, config), self._encode_fwdbwd
        return self.in_turn(req.model_id, req.seq_id, call)

    def optim_step(self, j: dict[str, Any]) -> dict[str, Any]:
        params = j.get("adam_params")
        if params is None:
            return self.failed(ValueError(f"only Adam is served (adam_params); got {sorted(j)}"))
        adam = AdamParams(**{k: v for k, v in params.items() if k in AdamParams.__dataclass_fields__})
        return self.in_turn(j["model_id"], j.get("seq_id"),
                            lambda c, m: (c.optim_step(adam), lambda r: {"metrics": r.metrics}))

    def save_weights(self, j: dict[str, Any]) -> dict[str, Any]:
        model_id, name = j["model_id"], j["path"]

        def call(client: TrainingClient, m: Model) -> tuple[Future, Any]:
            expires_in = ttl(j.get("ttl_seconds"))

            def saved(path: str) -> dict[str, Any]:
                m.checkpoints[f"weights/{name}"] = checkpoint = Checkpoint("training", path, j.get("user_metadata"))
                checkpoint.expire_after(expires_in)
                return {"path": f"tinker://{model_id}/weights/{name}", "type": "save_weights"}
            return client.save_state(name), saved
        return self.in_turn(model_id, j.get("seq_id"), call)

    def load_weights(self, j: dict[str, Any]) -> dict[str, Any]:
        """Into a training client (``model_id``: ``load_state``), or into a new one (``session_id`` and
        ``model_seq_id``: ``create_training_client_from_state``, with the source run's LoRA rank)."""
        try:
            source, checkpoint = self.find(j["path"], "training")
        except FileNotFoundError as e:
            return self.failed(e)
        path = checkpoint.location
        if "model_id" in j:
            return self.in_turn(j["model_id"], j.get("seq_id"), lambda c, m: (
                (c.load_state_with_optimizer if j.get("optimizer") else c.load_state)(path),
                lambda _: {"path": j["path"], "type": "load_weights"}))
        model_id = f"{j['session_id']}:train:{j['model_seq_id']}"

        def build() -> TrainingClient:
            client = self._new_client(model_id, source.rank, 0)
            (client.load_state_with_optimizer if j.get("optimizer") else client.load_state)(path).result()
            return client
        client = self._builder.submit(build)
        with self.lock:
            self.models[model_id] = Model(client, self.name, source.rank)
        return self.future(client, lambda _: {"path": j["path"], "model_id": model_id, "type": "load_weights"},
                           model_id=model_id)

    def _new_client(self, model_id: str, rank: int | None, seed: int) -> TrainingClient:
        root = self.root / model_id.replace(":", "_") if self.root is not None else None
        return TrainingClient(self.model, self.tokenizer, rank=rank, seed=seed, root=root, **self.strategy_kwargs)

    def save_weights_for_sampler(self, j: dict[str, Any]) -> dict[str, Any]:
        model_id = j["model_id"]
        if j.get("path"):
            name = j["path"]
            session = f"{model_id}:sampler:{name}"

            def named(client: TrainingClient, m: Model) -> tuple[Future, Any]:
                expires_in = ttl(j.get("ttl_seconds"))
                fut = client.save_weights_and_get_sampling_client()
                self.samplers[session] = fut
                m.checkpoints[f"sampler_weights/{name}"] = checkpoint = Checkpoint("sampler", session,
                                                                                   j.get("user_metadata"))
                checkpoint.expire_after(expires_in)
                return fut, lambda _: {"path": f"tinker://{model_id}/sampler_weights/{name}",
                                       "type": "save_weights_for_sampler"}
            return self.in_turn(model_id, j.get("seq_id"), named)
        session = f"{model_id.split(':train:')[0]}:sample:{j['sampling_session_seq_id']}"

        def ephemeral(client: TrainingClient, m: Model) -> tuple[Future, Any]:
            fut = client.save_weights_and_get_sampling_client()
            self.samplers[session] = fut
            return fut, lambda _: {"sampling_session_id": session, "type": "save_weights_for_sampler"}
        return self.in_turn(model_id, j.get("seq_id"), ephemeral)

    def create_sampling_session(self, j: dict[str, Any]) -> dict[str, Any]:
        session = f"{j['session_id']}:sample:{j['sampling_session_seq_id']}"
        path = j.get("model_path")
        if path:
            self.samplers[session] = self.samplers[self.find(path, "sampler")[1].location]
        else:  # the base model: a training client that never trains
            self.check_name(j.get("base_model"))
            base = self._builder.submit(TrainingClient, self.model, self.tokenizer, **self.strategy_kwargs)
            self.samplers[session] = self._builder.submit(lambda: base.result().save_weights_and_get_sampling_client()
                                                          .result())
        return {"type": "create_sampling_session", "sampling_session_id": session}

    def asample(self, j: dict[str, Any]) -> dict[str, Any]:
        n = int(j.get("num_samples", 1))
        ids = [uuid.uuid4().hex[:12] for _ in range(n)]
        session = self.samplers.get(j.get("sampling_session_id", ""))
        if session is None:
            return self.failed(KeyError(f"no sampling session {j.get('sampling_session_id')!r}"))
        unserved = {k: j[k] for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k",
                                      "record_stability_info") if j.get(k)}
        unserved.update({k: j[k] for k in ("target_prompt_logprobs", "prompt_logprobs_last_n") if j.get(k) is not None})
        if unserved:
            return self.failed(ValueError(f"sample options {sorted(unserved)} are not served (top-k and alternative "
                                          "log-probs, target prompt log-probs, the last-n prompt window and "
                                          "stability records): this server returns the sampled tokens' log-probs, "
                                          "and with include_prompt_logprobs=True every prompt token's"))
        prompt = [t for chunk in j["prompt"]["chunks"] for t in chunk.get("tokens", [])]
        params = SamplingParams(**{k: v for k, v in (j.get("sampling_params") or {}).items()
                                   if k in SamplingParams.__dataclass_fields__})
        sampler: SamplingClient = session.result()
        samples = sampler.sample(prompt, n, params)
        logprobs = sampler.compute_logprobs(prompt) if j.get("prompt_logprobs") else None
        return self.future(samples, lambda out: self._encode_sample(out, logprobs.result() if logprobs else None),
                           sample_sequence_ids=ids)

    # -- protobuf -------------------------------------------------------------------------------
    def _tokens(self, chunks: Any) -> list[int]:
        out: list[int] = []
        for chunk in chunks:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise ValueError(f"only text chunks are served, got a {chunk.WhichOneof('chunk')!r} chunk")
            out.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        return out

    def _tensor(self, t: Any) -> torch.Tensor:
        pb = self.pb
        dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
        if t.WhichOneof("encoding") == "sparse_csr":
            raise ValueError("sparse (2-D) loss_fn_inputs are not served")
        if t.dtype not in dtypes:
            raise ValueError(f"tensor dtype {t.dtype} is not served (float32, int64, int32)")
        return torch.from_numpy(np.frombuffer(t.dense, dtype=dtypes[t.dtype]).reshape(list(t.shape) or [-1]).copy())

    def _encode_fwdbwd(self, out: Any) -> bytes:
        msg = self.pb.ForwardBackwardOutput()
        msg.loss_fn_output_type = "ArrayRecord"
        for k, v in out.metrics.items():
            msg.metrics[k] = float(v)
        record = msg.loss_fn_outputs.add()
        record.num_datums = len(out.loss_fn_outputs)
        batched = record.fields["logprobs"]
        batched.dtype = self.pb.DTYPE_FLOAT32
        arrays = [o["logprobs"].float().numpy() for o in out.loss_fn_outputs]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64).tobytes()  # byte offsets
        return msg.SerializeToString()

    def _encode_sample(self, out: Any, prompt_logprobs: list[float | None] | None) -> bytes:
        pb = self.pb
        msg = pb.SampleResponse()
        for s in out.sequences:
            seq = msg.sequences.add()
            seq.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
            seq.tokens = np.asarray(s.tokens, np.int32).tobytes()
            seq.logprobs = np.asarray(s.logprobs, np.float32).tobytes()
        if prompt_logprobs is not None:
            values = [math.nan if v is None else v for v in prompt_logprobs]  # NaN: None in the SDK
            msg.prompt_logprobs = np.asarray(values, np.float32).tobytes()
        return msg.SerializeToString()

    # -- REST -----------------------------------------------------------------------------------
    # -- checkpoints ----------------------------------------------------------------------------
    def find(self, tinker_path: str, kind: str | None = None) -> tuple[Model, Checkpoint]:
        """The run and checkpoint at ``tinker_path`` (of ``kind`` where given); a clear error for one
        that is not here, or was deleted or expired."""
        run, _, checkpoint_id = tinker_path.removeprefix("tinker://").partition("/")
        m = self.models.get(run)
        checkpoint = m.checkpoints.get(checkpoint_id) if m is not None else None
        what = {"training": "state (save_state writes them)", "sampler": "sampler weights (save_weights_for_sampler "
                "writes them)"}.get(kind or "", "checkpoint")
        if checkpoint is None or (kind is not None and checkpoint.kind != kind):
            gone = f": it {self.gone[tinker_path]}" if tinker_path in self.gone else ""
            raise FileNotFoundError(f"no {what} {tinker_path!r} on this server{gone}")
        return m, checkpoint

    def set_ttl(self, tinker_path: str, j: dict[str, Any]) -> dict[str, Any]:
        """``set_checkpoint_ttl_from_tinker_path``: expire ``ttl_seconds`` from now (``None``: never)."""
        self.find(tinker_path)[1].expire_after(ttl(j.get("ttl_seconds")))
        return {}

    def remove(self, tinker_path: str, how: str) -> None:
        """Forget a checkpoint and delete what it holds (a state's folder; a sampler's session)."""
        run, _, checkpoint_id = tinker_path.removeprefix("tinker://").partition("/")
        with self.lock:
            checkpoint = self.models[run].checkpoints.pop(checkpoint_id, None)
            if checkpoint is None:
                return
            self.gone[tinker_path] = how
            if checkpoint.kind == "sampler":
                self.samplers.pop(checkpoint.location, None)
        if checkpoint.kind == "training":
            shutil.rmtree(checkpoint.location, ignore_errors=True)
        log.info("checkpoint %s %s", tinker_path, how)

    def expire(self) -> None:
        """Remove the checkpoints whose TTL has passed (lazily: before each request is served)."""
        at = now()
        with self.lock:
            expired = [(f"tinker://{run}/{cid}", c.expires_at) for run, m in self.models.items()
                       for cid, c in list(m.checkpoints.items()) if c.expired(at)]
        for path, expires_at in expired:
            self.remove(path, f"expired at {expires_at.isoformat()} (its ttl_seconds) and was deleted")

    def checkpoints(self, run: str | None = None) -> dict[str, Any]:
        """``run``'s checkpoints (``None``: every run's)."""
        runs = [run] if run is not None else list(self.models)
        listed = [c.listing(f"tinker://{r}/{cid}", cid) for r in runs for cid, c in self.models[r].checkpoints.items()]
        return {"checkpoints": listed, "cursor": {"offset": 0, "limit": len(listed), "total_count": len(listed)}}

    def training_run(self, run: str) -> dict[str, Any]:
        m = self.models[run]
        return {"training_run_id": run, "base_model": m.base_model, "model_owner": "local", "is_lora": m.rank is not None,
                "lora_rank": m.rank, "corrupted": False, "last_request_time": "1970-01-01T00:00:00Z"}

    def training_runs(self) -> dict[str, Any]:
        runs = [self.training_run(r) for r in self.models]
        return {"training_runs": runs, "cursor": {"offset": 0, "limit": len(runs), "total_count": len(runs)}}

    def weights_info(self, tinker_path: str) -> dict[str, Any]:
        m = self.find(tinker_path)[0]
        return {"base_model": m.base_model, "is_lora": m.rank is not None, "lora_rank": m.rank,
                "optimizer_config": {"type": "adamw"}}

    # -- sessions -------------------------------------------------------------------------------
    def create_session(self, j: dict[str, Any]) -> dict[str, Any]:
        session = Session.from_request(f"local-{uuid.uuid4().hex[:8]}", j)
        with self.lock:
            self.sessions[session.session_id] = session
        return {"type": "create_session", "session_id": session.session_id}

    def heartbeat(self, j: dict[str, Any]) -> tuple[int, dict[str, Any]] | dict[str, Any]:
        """410 for a finished (or unknown) session, as the hosted service answers: the only answer that
        stops the SDK's heartbeat loop (``lib/internal_client_holder.py:568-596``); the loops of the
        holders that ``ServiceClient.close`` does not close (a sampling client's pickled or
        ``from_sampler_handle`` copy) stop at their next beat."""
        s = self.sessions.get(j.get("session_id", ""))
        if s is None or s.status["type"] != "active":
            return 410, {"detail": f"session {j.get('session_id')!r} has finished"}
        return {"type": "session_heartbeat"}

    def session(self, session_id: str) -> tuple[int, dict[str, Any]] | dict[str, Any]:
        """The SDK's ``GetSessionResponse``: the session's training runs and samplers."""
        s = self.sessions.get(session_id)
        if s is None:
            return 404, {"detail": f"no session {session_id!r} on this server"}
        return {"training_run_ids": [m for m in self.models if s.owns(m)],
                "sampler_ids": [x for x in self.samplers if s.owns(x)],
                "user_metadata": s.user_metadata, "display_name": s.display_name}

    def list_sessions(self, query: dict[str, list[str]]) -> dict[str, Any]:
        """The SDK's ``ListSessionsResponse``: ids, newest first, ``offset``/``limit`` (default 20)."""
        offset, limit = int(query.get("offset", ["0"])[0]), int(query.get("limit", ["20"])[0])
        newest = sorted(self.sessions.values(), key=lambda s: (s.created_at, s.session_id), reverse=True)
        return {"sessions": [s.session_id for s in newest[offset:offset + limit]]}

    def search_sessions(self, j: dict[str, Any]) -> dict[str, Any]:
        def count(session_id: str) -> int:
            return sum(len(m.checkpoints) for run, m in self.models.items() if run.split(":", 1)[0] == session_id)
        return search(list(self.sessions.values()), j, count)

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.name, "trainable": True, "sampleable": True}]}

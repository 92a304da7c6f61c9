"""A local server that the unchanged ``tinker`` SDK (0.38) talks to, backed by the in-process
primitives (:class:`~rltrainer.own_loop.TrainingClient`): ``rltrainer serve`` or
``python -m rltrainer.own_loop.server``, on 127.0.0.1.

Point the SDK at it with ``tinker.ServiceClient(base_url="http://127.0.0.1:PORT")`` and
``TINKER_API_KEY=tml-local`` (the SDK needs a key that starts with ``tml-``; this server does not
check it and exchanges no tokens: ``pjwt_auth_enabled`` is false). The wire protocol, read from the
SDK's source, is mapped in ``/work/runs/tinker_protocol.md``; in short:

- every training and sampling call answers ``{"request_id"}`` at once and is fetched by
  ``retrieve_future``, which this server holds open (long poll) until the result is ready;
- calls of one training client are run in ``seq_id`` order (the SDK submits the next before the
  previous is done), by that client's one worker thread;
- ``forward_backward``'s body and the ``ForwardBackwardOutput``/``SampleResponse`` results are the
  SDK's protobuf messages (``tinker.proto.tinker_public_pb2``, imported from the installed SDK);
  everything else is JSON; a failed call answers ``{"error", "category": "user"}`` in its future.

The SDK only asks for LoRA training clients; ``full=True`` (``--full``) trains every parameter
instead for each of them, and ``get_info`` says so (``is_lora`` false).

The served name (``--name``, what clients pass as ``base_model``) is by default the tokenizer's
folder (an absolute path), because the SDK's ``SamplingClient.get_tokenizer`` loads the tokenizer
by that name and nothing else (:func:`~rltrainer.own_loop.service.sdk_tokenizer_name`). The state and what each call does are
:class:`~rltrainer.own_loop.service.LocalTinker`'s; this module is the HTTP side and the command.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rltrainer.own_loop.service import PREFIX, LocalTinker, sdk_tokenizer_name

log = logging.getLogger(__name__)


class Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive (the SDK pools connections); routes to :attr:`state`."""

    protocol_version = "HTTP/1.1"
    state: LocalTinker

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._dispatch(b"")

    def do_POST(self) -> None:
        self._dispatch(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

    do_PUT = do_POST
    do_DELETE = do_POST

    def _send(self, status: int, body: bytes | dict[str, Any], kind: str = "json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/x-protobuf" if kind == "proto" else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _dispatch(self, body: bytes) -> None:
        url = urlsplit(self.path)
        path, query = url.path, parse_qs(url.query)
        if not path.startswith(PREFIX):
            return self._send(404, {"detail": f"no route {path}"})
        j: dict[str, Any] = {}
        try:
            is_json = body and "json" in (self.headers.get("Content-Type") or "")
            j = json.loads(body) if is_json else {}
            out = self._route(self.command, path[len(PREFIX):], body, j, query)
        except Exception as e:  # noqa: BLE001 - a bad request: 400 with a body (a bare 400 is retried)
            log.warning("%s %s failed: %s", self.command, path, e, exc_info=e)
            self.state.skip_turn(j)
            return self._send(400, {"detail": f"{type(e).__name__}: {e}"})
        if out is None:
            self.state.skip_turn(j)
            return self._send(404, {"detail": f"not served: {self.command} {path}"})
        self._send(*out) if isinstance(out, tuple) else self._send(200, out)

    def _route(self, verb: str, path: str, body: bytes, j: dict[str, Any], query: dict[str, list[str]]) -> Any:
        s = self.state
        s.expire()
        simple = {
            "/client/config": lambda: {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False,
                                       "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                                       "sample_join_sampling_session": False},
            "/client/dynamic_config": lambda: {"refresh_interval_sec": 300, "sample_cancel_enabled": False},
            "/create_session": lambda: s.create_session(j),
            "/session_heartbeat": lambda: s.heartbeat(j),
            "/telemetry": lambda: {"status": "accepted"},
            "/healthz": lambda: {"status": "ok"},
            "/get_server_capabilities": s.capabilities,
            "/create_model": lambda: s.create_model(j),
            "/get_info": lambda: s.info(j["model_id"]),
            "/forward_backward": lambda: s.forward_backward(body),
            "/optim_step": lambda: s.optim_step(j),
            "/save_weights": lambda: s.save_weights(j),
            "/load_weights": lambda: s.load_weights(j),
            "/save_weights_for_sampler": lambda: s.save_weights_for_sampler(j),
            "/create_sampling_session": lambda: s.create_sampling_session(j),
            "/asample": lambda: s.asample(j),
            "/retrieve_future": lambda: s.retrieve(j["request_id"]),
            "/weights_info": lambda: s.weights_info(j["tinker_path"]),
            "/training_runs": s.training_runs,
            "/checkpoints": s.checkpoints,
            "/sessions": lambda: s.list_sessions(query),
            "/sessions/search": lambda: s.search_sessions(j),
        }
        if path in simple:
            return simple[path]()
        if path.startswith("/sessions/"):
            session_id, _, rest = path[len("/sessions/"):].partition("/")
            if rest == "finish":
                if session_id in s.sessions:
                    s.sessions[session_id].finish(j)
                return {}
            if rest == "" and verb == "GET":
                return s.session(session_id)
        if path.startswith("/samplers/"):
            return {"sampler_id": path[len("/samplers/"):], "base_model": s.name}
        if path.startswith("/training_runs/"):
            run, _, rest = path[len("/training_runs/"):].partition("/checkpoints")
            if run not in s.models:
                return 404, {"detail": f"no training run {run!r}"}
            if not _ and verb == "GET":
                return s.training_run(run)
            if verb == "GET" and rest == "":
                return s.checkpoints(run)
            if verb == "DELETE" and rest.startswith("/") and rest.count("/") == 2:  # /weights/<name>
                s.remove(f"tinker://{run}{rest}", "was deleted")
                return {}
            if verb == "PUT" and rest.endswith("/ttl") and rest.count("/") == 3:  # /weights/<name>/ttl
                return s.set_ttl(f"tinker://{run}{rest.removesuffix('/ttl')}", j)
        return None


def serve(state: LocalTinker, port: int = 0, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A started server (``port=0``: a free one, ``server.server_address[1]``) in a daemon thread."""
    handler = type("BoundHandler", (Handler,), {"state": state})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="rltrainer-serve", daemon=True).start()
    return server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="hub id or local folder of a causal LM")
    parser.add_argument("--tokenizer", help="the tokenizer's folder (default: the model's)")
    parser.add_argument("--name", help="the base_model name clients ask for (default: the tokenizer's absolute "
                        "folder, or its hub id: the SDK's SamplingClient.get_tokenizer loads the tokenizer by this name)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--root", help="where save_state writes (default: a temporary folder per client)")
    parser.add_argument("--full", action="store_true", help="train every parameter for the SDK's LoRA clients")
    parser.add_argument("--device", default="cpu", help="the 'single' strategy's device")


def run(args: argparse.Namespace) -> None:
    """``rltrainer serve``: serve until interrupted."""
    from transformers import AutoTokenizer

    tokenizer_id = args.tokenizer or args.model
    if Path(tokenizer_id).is_dir():  # the SDK's get_tokenizer loads it by this path, offline
        tokenizer_id = str(Path(tokenizer_id).resolve())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_id)
    state = LocalTinker(args.model, tokenizer, name=args.name, tokenizer_id=tokenizer_id, root=args.root, full=args.full,
                        strategy="single", device=args.device)
    if args.name is not None and args.name != sdk_tokenizer_name(tokenizer_id):
        log.info("SamplingClient.get_tokenizer() loads the tokenizer by the served name %r, not from %s; "
                 "leave --name out to serve under the tokenizer's folder", args.name, tokenizer_id)
    server = serve(state, args.port)
    print(f"Serving {state.name} on http://127.0.0.1:{server.server_address[1]} "
          "(TINKER_API_KEY=tml-local; Ctrl-C stops)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()


def main(argv: list[str] | None = None, prog: str = "python -m rltrainer.own_loop.server") -> int:
    """``rltrainer serve ...``: parse, serve until Ctrl-C; 2 for a refused command line."""
    parser = argparse.ArgumentParser(prog=prog, description="A local server the unchanged tinker SDK (0.38) talks "
                                                            "to, training with rltrainer (TINKER_API_KEY=tml-local).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

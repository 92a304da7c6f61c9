"""The local Tinker server on a free port, in this process, for the SDK-driven tests."""

from __future__ import annotations

import pytest

from rltrainer.testing import data_path


@pytest.fixture
def server(bpe_tokenizer, tiny_config, tmp_path, monkeypatch):
    """``(state, url)``: a :class:`~rltrainer.own_loop.service.LocalTinker` serving a tiny Qwen2 under
    its default name (``state.name``: the tokenizer's folder), with the SDK's environment set (a
    ``tml-`` key, no telemetry, the hub offline)."""
    pytest.importorskip("tinker", reason="the server's tests drive the tinker SDK: pip install tinker==0.38.0")
    from rltrainer.own_loop.server import LocalTinker, serve

    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    state = LocalTinker(tiny_config, bpe_tokenizer, root=tmp_path,
                        tokenizer_id=str(data_path("tokenizers", "gsm8k-bpe4k")))
    http = serve(state)
    yield state, f"http://127.0.0.1:{http.server_address[1]}"
    unclosed = [sid for sid, session in state.sessions.items() if session.status["type"] == "active"]
    http.shutdown()
    http.server_close()  # later connections are refused at once, not left to time out
    assert not unclosed, (f"sessions {unclosed} were not finished: close each tinker.ServiceClient (`with "
                          "tinker.ServiceClient(base_url=url) as service:`) before the server stops, or its "
                          "heartbeat warns 'Session heartbeat failed' for the rest of the run")

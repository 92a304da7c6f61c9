"""Issue 46, point 5: the cost of the primitives per call, against the update Trainer.fit runs.

Times (median of REPS, one torch thread, a tiny Qwen2 over the 4k BPE, full-parameter) for one batch
of ROWS datums of N tokens under ``importance_sampling``:

- ``strategy.train_step`` alone: what ``Trainer.fit`` runs for the update of that batch;
- in process: ``forward_backward`` alone, and ``forward_backward`` + ``optim_step`` (the step:
  ``forward_backward``'s forward for its outputs, then the update);
- over the server: the same two through the unchanged tinker SDK (HTTP on the loopback, protobuf).

    python tests/benchmarks/bench_own_loop.py [TOKENS_PER_DATUM ...]   # default 64; several sizes
                                                                      # separate the server's fixed and per-token cost
"""
import os
import statistics
import sys
import time

import torch
os.environ.update(TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")
torch.set_num_threads(1)
import tinker  # noqa: E402
from rltrainer.testing import load_tokenizer, tiny_qwen2_config, data_path
from rltrainer.own_loop import TrainingClient, Datum, AdamParams
from rltrainer.own_loop import wiring
from rltrainer.own_loop.data import datums_batch
from rltrainer.own_loop.server import LocalTinker, serve

tok = load_tokenizer("gsm8k-bpe4k")
cfg = tiny_qwen2_config(len(tok), hidden_size=64, num_layers=2)
ROWS, REPS = 8, 15
SIZES = [int(a) for a in sys.argv[1:]] or [64]  # tokens per datum


def timed(fn):
    fn()  # warm
    ts = []
    for _ in range(REPS):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


client = TrainingClient(cfg, tok, rank=None, device="cpu")
adam = AdamParams(learning_rate=1e-4)
state = LocalTinker(cfg, tok, name="rltrainer/tiny", tokenizer_id=str(data_path("tokenizers", "gsm8k-bpe4k")), full=True)
http = serve(state)
service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{http.server_address[1]}")
tc = service.create_lora_training_client(base_model="rltrainer/tiny", rank=8).result()
served = state.models[tc.model_id].client.result()
overheads = {}
for N in SIZES:
    g = torch.Generator().manual_seed(0)
    raw = [dict(model_input=torch.randint(5, 4000, (N,), generator=g).tolist(), target_tokens=torch.randint(5, 4000, (N,), generator=g),
                logprobs=-torch.rand(N, generator=g) * 8, advantages=torch.randn(N, generator=g)) for _ in range(ROWS)]
    datums = [Datum(r["model_input"], {k: r[k] for k in ("target_tokens", "logprobs", "advantages")}) for r in raw]
    batch = datums_batch(datums, "importance_sampling", {})
    t_train = timed(lambda: wiring.train_step(client.strategy, batch, adam))
    t_fb = timed(lambda: (client.forward_backward(datums, "importance_sampling").result(), client._queue.clear()))
    t_step = timed(lambda: (client.forward_backward(datums, "importance_sampling"), client.optim_step(adam).result()))
    sdk = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(r["model_input"]),
                              loss_fn_inputs={k: tinker.types.TensorData.from_torch(r[k]) for k in ("target_tokens", "logprobs", "advantages")}) for r in raw]
    t_srv_fb = timed(lambda: (tc.forward_backward(sdk, "importance_sampling").result(), served._queue.clear()))
    t_srv_step = timed(lambda: (tc.forward_backward(sdk, "importance_sampling"), tc.optim_step(tinker.types.AdamParams(learning_rate=1e-4)).result()))
    overheads[ROWS * N] = t_srv_fb - t_fb
    print(f"{ROWS} datums x {N} tokens, Qwen2 2 layers hidden 64, vocab {len(tok)}, full-parameter, 1 thread, median of {REPS}:")
    print(f"  strategy.train_step alone (Trainer.fit's update): {t_train:7.1f} ms")
    print(f"  in process: forward_backward {t_fb:7.1f} ms; forward_backward + optim_step {t_step:7.1f} ms "
          f"({t_step / t_train:.2f}x)")
    print(f"  over the server (SDK): forward_backward {t_srv_fb:7.1f} ms; forward_backward + optim_step {t_srv_step:7.1f} ms")
    print(f"  the server's forward_backward overhead: {t_srv_fb - t_fb:7.1f} ms for {ROWS * N} tokens", flush=True)
if len(overheads) > 1:  # least squares: overhead = fixed + per_token * tokens
    xs, ys = list(overheads), list(overheads.values())
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    print(f"the server's overhead per forward_backward: {my - slope * mx:.1f} ms fixed + {slope * 1e3:.2f} us per token "
          f"(least squares over {len(xs)} sizes)")
service.close("success").result()
http.shutdown()
client.close()

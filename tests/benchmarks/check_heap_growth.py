"""Heap growth of repeated update micro-batches (issue 16): the 4k benchmark model, the same 8 x 328-token
micro-batch forward + backward six times, holding each (loss, metrics) as run_micro_batches does; prints
process RSS and glibc in-use / free heap after each pass. TRIM=1 calls malloc_trim(0) after each pass; DETACH=1 holds
detached copies instead (no graph nodes kept); glibc's own settings through its environment
(MALLOC_MMAP_THRESHOLD_=1048576 ...). Ends with the run's peak RSS, CPU times and minor page faults.

    PYTHONPATH=$PWD python tests/benchmarks/check_heap_growth.py
    TRIM=1 PYTHONPATH=$PWD python tests/benchmarks/check_heap_growth.py
"""
import os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_trl import heap_gb, RssTrace
import ctypes, os
rss = RssTrace(1.0).rss_gb
TRIM = os.environ.get("TRIM") == "1"
DETACH = os.environ.get("DETACH") == "1"
from transformers import AutoModelForCausalLM, Qwen2Config
from rltrainer.models import response_log_probs
from rltrainer.data.batch import RolloutBatch
torch.set_num_threads(1); torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=1024, tie_word_embeddings=True)
model = AutoModelForCausalLM.from_config(cfg)
n, P, T = 8, 200, 128
ids = torch.randint(0, 4096, (n, P + T))
mb = RolloutBatch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(P + T).expand(n, -1),
                   "responses": ids[:, P:]}, batch_size=n)
hold = []
print("start", heap_gb(), flush=True)
for i in range(6):
    lp, ent = response_log_probs(model, mb, 1.0, with_entropy=True)
    loss = -(lp * 0.1).mean()
    metrics = {"kl": (lp - lp.detach() * 0.9).mean(), "ent": ent.mean()}
    loss.backward()
    if DETACH: loss, metrics = loss.detach(), {k: v.detach() for k, v in metrics.items()}
    hold.append((loss, metrics))
    if TRIM: ctypes.CDLL(None).malloc_trim(0)
    print(i, round(rss(), 3), {k: round(v, 3) for k, v in heap_gb().items()}, flush=True)
hold.clear()
print("cleared", heap_gb(), flush=True)
import resource
u = resource.getrusage(resource.RUSAGE_SELF)
print(f"peak RSS {u.ru_maxrss / 1024 ** 2:.3f} GB, user {u.ru_utime:.1f} s, sys {u.ru_stime:.1f} s, minor faults {u.ru_minflt}", flush=True)

"""By-hand check: the tinker cookbook's own minimal RL loop (``tinker_cookbook/recipes/rl_loop.py``,
tinker-cookbook 0.5.8) runs through ``rltrainer serve`` on a tiny model on CPU, and whether it learns.

    python tests/benchmarks/cookbook_rl_loop.py                      # from a checkout with the dev install
    python tests/benchmarks/cookbook_rl_loop.py --steps 30 --seed 1 --work /tmp/cookbook-run

What it does, in order:

1. installs tinker-cookbook 0.5.8 and what the loop imports with ``--no-deps`` into a cache folder
   (``~/.cache/rltrainer/tinker-cookbook-0.5.8``; skipped when there). 0.6.x needs tml-renderers>=0.4.1,
   which the index lacks; 0.5.8 pins transformers<=5.5.4, hence ``--no-deps`` (what the loop uses works
   with ours). Nothing of it goes into setup.cfg.
2. builds a tiny Qwen2 (the shipped 4k-entry BPE tokenizer ``gsm8k-bpe4k``: Qwen's 151k-entry one
   makes every step ~30x slower on CPU for the logits alone; nothing from the hub) in
   ``WORK/Qwen/Qwen3-8B-Base``: a relative folder under the name the cookbook knows, so that its
   ``get_tokenizer`` and renderer lookup (``role_colon``) and the SDK accept it unchanged. A short
   supervised warm-up on the loop's exact prompts teaches it to answer ``\\boxed{a+b}`` (partly right),
   and the addition problems are written shaped like GSM8K (``question``, ``answer`` ending ``#### n``)
   to ``WORK/addition_gsm8k.jsonl``; the held-out pairs are in neither.
3. copies the cookbook's ``rl_loop.py`` and changes only its ``load_dataset`` line (the diff is printed).
4. starts ``rltrainer serve --full`` (the SDK asks for a LoRA client; ``--full`` trains every
   parameter), samples the held-out problems on the initial weights through the SDK, runs the loop
   (its own command-line config: ``base_url``, ``model_name``, sizes, ``learning_rate``), samples them
   again on the loop's final sampler weights, and stops the server.
5. prints the loop's ``reward/total`` per step from the cookbook's ``metrics.jsonl`` and the held-out
   accuracy before and after (greedy, and the mean over 8 samples at temperature 1), graded by the
   cookbook's own functions (``extract_boxed``, ``extract_gsm8k_final_answer``, ``grade_answer``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

COOKBOOK = "0.5.8"
PACKAGES = [f"tinker-cookbook=={COOKBOOK}", "tml-renderers==0.2.1", "chz", "blobfile", "pyrage", "tiktoken",
            "pylatexenc", "math-verify"]
NAME = "Qwen/Qwen3-8B-Base"  # the cookbook's renderer table knows it: role_colon
REPO = Path(__file__).resolve().parents[2]
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
PREFIX = [  # rl_loop.py's convo_prefix, verbatim
    {"role": "user", "content": "How many r's are in strawberry?" + SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
                                     "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"},
]
DATASET_LINE = '    dataset = datasets.load_dataset("openai/gsm8k", "main")\n'


def split_pairs(seed: int, top: int, num_held_out: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All ``a + b`` with ``0 <= a, b < top``, shuffled by ``seed``: (train, held out)."""
    pairs = [(a, b) for a in range(top) for b in range(top)]
    random.Random(seed).shuffle(pairs)
    return pairs[num_held_out:], pairs[:num_held_out]


def gsm8k_row(a: int, b: int) -> dict[str, str]:
    """An addition problem shaped like a GSM8K row: the final answer after ``####``."""
    return {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}


def write_rows(path: Path, pairs: list[tuple[int, int]], rows: int, seed: int) -> None:
    rng = random.Random(seed + 1)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps(gsm8k_row(*rng.choice(pairs))) + "\n")


def run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def install(cache: Path) -> None:
    if (cache / "tinker_cookbook" / "recipes" / "rl_loop.py").exists():
        print(f"cookbook {COOKBOOK} already in {cache}", flush=True)
        return
    run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(cache), "--no-deps", *PACKAGES])


def grade(response: str, answer: str) -> float:
    """rl_loop.py's get_reward, with the cookbook's own functions."""
    from tinker_cookbook.recipes.math_rl.math_env import extract_gsm8k_final_answer
    from tinker_cookbook.recipes.math_rl.math_grading import extract_boxed, grade_answer

    try:
        return 1.0 if grade_answer(extract_boxed(response), extract_gsm8k_final_answer(answer)) else 0.0
    except ValueError:
        return 0.0


def renderer_and_tokenizer():
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    tokenizer = get_tokenizer(NAME)
    return renderers.get_renderer(model_info.get_recommended_renderer_name(NAME), tokenizer), tokenizer


def prompt(renderer, question: str):
    return renderer.build_generation_prompt([*PREFIX, {"role": "user", "content": question + SUFFIX}])


def warm_up(args: argparse.Namespace) -> None:
    """In WORK: the tiny model, its supervised warm-up, the rows. Runs with the cookbook importable."""
    import torch

    from rltrainer.own_loop import AdamParams, Datum, TrainingClient
    from rltrainer.testing import load_tokenizer, tiny_qwen2_config
    from transformers import AutoModelForCausalLM

    train, _ = split_pairs(args.seed, args.top, args.num_held_out)
    write_rows(Path("addition_gsm8k.jsonl"), train, args.rows, args.seed)
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.tokenizer)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(len(tokenizer), hidden_size=args.hidden))
    model.save_pretrained(NAME)
    tokenizer.save_pretrained(NAME)
    renderer, tokenizer = renderer_and_tokenizer()
    client = TrainingClient(NAME, tokenizer, strategy="single", device="cpu", seed=args.seed)
    rng = random.Random(args.seed + 2)
    for step in range(args.warmup_steps):
        data = []
        draw = rng.sample if args.warmup_batch <= len(train) else lambda pairs, k: rng.choices(pairs, k=k)
        for a, b in draw(train, args.warmup_batch):
            ids = prompt(renderer, gsm8k_row(a, b)["question"]).to_ints()
            answer = tokenizer.encode(f" \\boxed{{{a + b}}}\n\nUser:", add_special_tokens=False)
            full, n = ids + answer, len(ids) - 1
            data.append(Datum(full[:-1], {"target_tokens": torch.tensor(full[1:]),
                                          "weights": torch.tensor([0.0] * n + [1.0] * len(answer))}))
        out = client.forward_backward(data, "cross_entropy")
        client.optim_step(AdamParams(learning_rate=args.warmup_lr)).result()
        if step % 20 == 0 or step == args.warmup_steps - 1:
            print(f"warm-up step {step}: loss {out.result().metrics['loss:sum'] / args.warmup_batch:.3f}", flush=True)
    client.strategy.module.policy.save_pretrained(NAME)


def evaluate(args: argparse.Namespace) -> None:
    """Held-out accuracy through the SDK, on the base weights or a sampler path; prints one JSON line."""
    import tinker

    renderer, _ = renderer_and_tokenizer()
    _, held_out = split_pairs(args.seed, args.top, args.num_held_out)
    service = tinker.ServiceClient(base_url=args.base_url)
    if args.model_path:
        sampler = service.create_sampling_client(model_path=args.model_path)
    else:
        sampler = service.create_sampling_client(base_model=NAME)
    stop = renderer.get_stop_sequences()
    greedy = tinker.types.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=stop)
    hot = tinker.types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=stop,
                                     seed=args.seed)  # the same samples for the same weights
    rows = [gsm8k_row(a, b) for a, b in held_out]
    futures = [(sampler.sample(prompt(renderer, r["question"]), 1, greedy),
                sampler.sample(prompt(renderer, r["question"]), 8, hot)) for r in rows]
    scores = {"greedy": [], "sampled": []}
    for (g, h), row in zip(futures, rows):
        for key, future in (("greedy", g), ("sampled", h)):
            for sequence in future.result().sequences:
                message, _ = renderer.parse_response(sequence.tokens)
                from tinker_cookbook import renderers
                scores[key].append(grade(renderers.get_text_content(message), row["answer"]))
    print(json.dumps({k: sum(v) / len(v) for k, v in scores.items()}), flush=True)


def patched_loop(cache: Path, work: Path) -> Path:
    source = (cache / "tinker_cookbook" / "recipes" / "rl_loop.py").read_text().splitlines(keepends=True)
    if source.count(DATASET_LINE) != 1:
        raise SystemExit(f"rl_loop.py of tinker-cookbook {COOKBOOK} no longer has the line {DATASET_LINE!r}")
    local = DATASET_LINE.replace('"openai/gsm8k", "main"',
                                 f'"json", data_files={{"train": "{work / "addition_gsm8k.jsonl"}"}}')
    patched = [local if line == DATASET_LINE else line for line in source]
    sys.stdout.writelines(difflib.unified_diff(source, patched, "rl_loop.py", "rl_loop_local.py"))
    out = work / "rl_loop_local.py"
    out.write_text("".join(patched))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(port: int, server: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"rltrainer serve exited with {server.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"rltrainer serve did not listen on {port} within {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/rltrainer-cookbook-rl-loop"))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "rltrainer" / f"tinker-cookbook-{COOKBOOK}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30, help="the loop's max_steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3, help="the loop's learning_rate (every parameter trains)")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--top", type=int, default=10, help="a and b run over 0..top-1")
    parser.add_argument("--num-held-out", type=int, default=25)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tokenizer", default="gsm8k-bpe4k", help="a shipped tokenizer (qwen2.5-instruct: slower)")
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--warmup-lr", type=float, default=1e-2)
    parser.add_argument("--warmup-batch", type=int, default=16)
    parser.add_argument("--part", choices=["all", "warm-up", "evaluate"], default="all", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "warm-up":
        return warm_up(args)
    if args.part == "evaluate":
        return evaluate(args)

    start = time.perf_counter()
    cache, work = args.cache.resolve(), args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    install(cache)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_API_KEY": "tml-local",
           "TINKER_TELEMETRY": "0", "PYTHONPATH": os.pathsep.join([str(cache), str(REPO)])}
    common = ["--seed", str(args.seed), "--top", str(args.top), "--num-held-out", str(args.num_held_out),
              "--max-tokens", str(args.max_tokens)]
    me = [sys.executable, str(Path(__file__).resolve())]
    run([*me, "--part", "warm-up", *common, "--rows", str(args.rows), "--hidden", str(args.hidden), "--tokenizer", args.tokenizer,
         "--warmup-steps", str(args.warmup_steps), "--warmup-lr", str(args.warmup_lr),
         "--warmup-batch", str(args.warmup_batch)], cwd=work, env=env)
    loop = patched_loop(cache, work)
    log = work / f"log-seed{args.seed}"
    if log.exists():  # the cookbook resumes from a log folder's checkpoints: start afresh
        for f in log.iterdir():
            f.unlink()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_env = {**env, "PYTHONPATH": str(REPO)}  # the server needs no cookbook
    with open(work / "serve.log", "w") as serve_log:
        server = subprocess.Popen([sys.executable, "-m", "rltrainer", "serve", "--model", NAME, "--name", NAME,
                                   "--port", str(port), "--full"], cwd=work, env=server_env, stdout=serve_log,
                                  stderr=subprocess.STDOUT)
    try:
        wait_for(port, server)
        scores = {}
        for when, path in (("before", None), ("after", "final")):
            if path:
                run([sys.executable, str(loop), f"base_url={url}", f"model_name={NAME}",
                     f"batch_size={args.batch_size}", f"group_size={args.group_size}",
                     f"max_tokens={args.max_tokens}", f"max_steps={args.steps}", f"learning_rate={args.lr}",
                     "save_every=0", f"log_path={log}"], cwd=work, env=env)
                checkpoints = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]
                path = [c["sampler_path"] for c in checkpoints if c.get("name") == "final"][-1]
            out = subprocess.run([*me, "--part", "evaluate", *common, "--base-url", url,
                                  *(["--model-path", path] if path else [])],
                                 cwd=work, env=env, check=True, capture_output=True, text=True)
            scores[when] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.terminate()
        server.wait(timeout=60)
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    print("reward/total per step (the cookbook's metrics.jsonl):")
    print(" ".join(f"{m['reward/total']:.3f}" for m in metrics))
    first, last = metrics[: len(metrics) // 3], metrics[-(len(metrics) // 3):]
    print(f"mean reward, first third {sum(m['reward/total'] for m in first) / len(first):.3f}, "
          f"last third {sum(m['reward/total'] for m in last) / len(last):.3f}")
    skipped = sum("loss:sum" not in m for m in metrics)
    print(f"steps without a training step (all advantages zero): {skipped} of {len(metrics)}")
    b, a = scores["before"], scores["after"]
    print(f"held-out ({args.num_held_out} problems) greedy {b['greedy']:.1%} -> {a['greedy']:.1%}, "
          f"sampled (8 each, T=1) {b['sampled']:.1%} -> {a['sampled']:.1%}; "
          f"seed {args.seed}, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

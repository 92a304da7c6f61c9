"""Multi-turn rollouts: episodes of an :class:`~rltrainer.envs.Environment`, driven by the
controller through the engine contract (``engine.generate_async``), laid out as one
:class:`~rltrainer.data.batch.RolloutBatch` row each.

A row's response is the whole episode after the first prompt: the model's turns, exactly the tokens
the engine sampled (``response_mask`` 1, ``rollout_log_probs`` the engine's), and between them the
environment's observations and tool results, rendered by the chat template
(:class:`~rltrainer.envs.chat.ChatFormat`; ``response_mask`` 0, ``attention_mask`` 1). So the
trainer's teacher-forced log-probs score the very tokens the engine scored.

Episodes of a batch run concurrently: environment calls run in a thread pool, and whenever episodes
wait for the model, the controller sends their contexts to the engine as one request (after at most
``batch_wait_s`` for others to join), so a slow environment holds only its own episode. Any engine
works (``hf``, vLLM, SGLang, colocated or split; a replica in the async pipelines). Under an async
pipeline a weight push may land between two turns of an episode: each token's rollout log-prob is
still the one it was sampled with, and the row's ``policy_version`` is its oldest turn's.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrainer.data.batch import RolloutBatch, routes_as_rows
from rltrainer.envs.chat import ChatFormat
from rltrainer.envs.environment import as_messages, as_step_result, check_environment, tool_methods, tool_schemas
from rltrainer.envs.tools import parser_for, run_tool
from rltrainer.rollout.engine import RolloutEngine, SamplingParams
from rltrainer.values import check_float, check_int

log = logging.getLogger(__name__)
_LOGGED: set[tuple[str, str, str]] = set()  # (environment, phase, error type) already logged in this process
_LOG_LOCK = threading.Lock()

#: Why an episode ended (``env_finish``).
FINISHES = ("done", "max_turns", "max_tokens", "error")


@dataclass
class Episode:
    """One episode's state: its environment, the first prompt, and the response grown so far."""

    row: dict[str, Any]
    env: Any = None
    tools: dict[str, Callable[..., Any]] = field(default_factory=dict)
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the response: model and environment tokens
    mask: list[int] = field(default_factory=list)  # 1 on model tokens
    log_probs: list[float] = field(default_factory=list)  # the engine's, 0 on environment tokens
    rewards: list[float] = field(default_factory=list)  # per model turn
    turn_texts: list[str] = field(default_factory=list)
    finish: str | None = None  # None while running; else one of FINISHES
    error: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    version: int | None = None  # the oldest weight version among its turns
    routes: Any = None  # a MoE policy's routes of its last turn's request: [prompt + tokens so far, L, K]
    abandoned: bool = False  # its environment call timed out; its thread may still run


class MultiTurn:
    """Multi-turn rollouts with an environment; give it to ``GRPO(environment=...)`` (or set
    ``module.environment``): the default ``rollout_step`` and ``validation_step`` then run episodes.

    Args:
        environment: a class (or zero-argument callable) making one environment per episode:
            :class:`~rltrainer.envs.Environment`'s ``reset`` / ``step`` and tools.
        max_turns: model turns per episode (tool-calling turns included).
        max_episode_tokens: tokens of an episode after its first prompt (model and environment
            tokens). A model turn gets at most the rest (and ``max_new_tokens``); an observation that
            does not fit ends the episode (``env_finish`` ``"max_tokens"``).
        tool_parser: a name in :data:`~rltrainer.envs.TOOL_PARSERS`; ``None``: the chat template's own
            format (Hermes ``<tool_call>`` for Qwen2.5 / Qwen3). Only read if the environment has tools.
        template_kwargs: extra chat-template variables (``{"enable_thinking": False}`` for Qwen3).
        max_workers: threads running environment calls (kept between batches); ``0``: the calls run
            in the controller thread, one after another (fastest for environments that only compute
            a little, as thread hand-offs then cost more than the calls).
        batch_wait_s: how long episodes ready for the model wait for others to join their request.
        env_timeout_s: an environment call (``reset``, ``step``, a tool) running longer ends its
            episode as an error (``None``: no limit). The call's thread is left to finish.

    An environment that raises ends that episode only (``env_finish`` ``"error"``, its tokens not
    trained on: ``response_mask`` 0, reward 0); the error is counted (``env/errors``) and logged
    once per environment class, phase and error type, with its traceback.

    Rows it returns carry, besides the fields of ``rollout_step``: ``env_reward`` (float, the sum of
    the turns' rewards), ``env_turns``, ``env_finish``, ``env_error`` and ``turn_rewards``
    (non-tensor); ``response_text`` is the whole response decoded. ``finish_reason`` is ``"stop"``
    when the environment ended the episode, ``"length"`` at a limit, ``"error"`` on an error.
    """

    def __init__(self, environment: Any, max_turns: int = 4, max_episode_tokens: int = 1024,
                 tool_parser: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 max_workers: int = 32, batch_wait_s: float = 0.02, env_timeout_s: float | None = None) -> None:
        check_environment(environment)
        max_turns = check_int("max_turns", max_turns, at_least=1, owner="MultiTurn")
        max_episode_tokens = check_int("max_episode_tokens", max_episode_tokens, at_least=1, owner="MultiTurn")
        max_workers = check_int("max_workers", max_workers, at_least=0, owner="MultiTurn",
                                meaning="0 runs them in the controller thread")
        batch_wait_s = check_float("batch_wait_s", batch_wait_s, at_least=0, owner="MultiTurn")
        env_timeout_s = check_float("env_timeout_s", env_timeout_s, above=0, none="no limit", owner="MultiTurn")
        self.environment = environment
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.tool_parser, self.template_kwargs = tool_parser, dict(template_kwargs or {})
        self.max_workers, self.batch_wait_s, self.env_timeout_s = max_workers, batch_wait_s, env_timeout_s
        self._pool: ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None  # threads stay in the process that made them
        return state

    def executor(self) -> Any:
        """The threads for environment calls (made once), or an inline stand-in (``max_workers=0``)."""
        if self.max_workers == 0:
            return _Inline()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="rltrainer-env")
        return self._pool

    # -- one batch -----------------------------------------------------------------------------
    def rollout(self, batch: RolloutBatch, engine: RolloutEngine, sampling: SamplingParams,
                tokenizer: Any) -> RolloutBatch:
        """``sampling.n`` episodes per prompt row, one row each (samples of a prompt adjacent)."""
        n = sampling.n
        out = batch.repeat(n, interleave=True)
        uids = [uuid.uuid4().hex for _ in range(len(batch))]
        out["uid"] = [u for u in uids for _ in range(n)]
        rows = [{k: v[i] for k, v in out.non_tensors.items()} for i in range(len(out))]
        episodes = [Episode(row=row) for row in rows]
        start = time.perf_counter()
        runner = _Runner(self, engine, sampling, tokenizer)
        runner.run(episodes)
        return self._layout(out, episodes, tokenizer, sampling, runner, time.perf_counter() - start)

    def _layout(self, out: RolloutBatch, episodes: list[Episode], tokenizer: Any, sampling: SamplingParams,
                runner: _Runner, elapsed: float) -> RolloutBatch:
        pad = tokenizer.pad_token_id
        P = max(len(e.prompt) for e in episodes)
        T = max(max(len(e.tokens) for e in episodes), 1)
        N = len(episodes)
        prompts = torch.full((N, P), pad, dtype=torch.long)
        prompt_mask = torch.zeros((N, P), dtype=torch.long)
        responses = torch.full((N, T), pad, dtype=torch.long)
        real = torch.zeros((N, T), dtype=torch.long)
        model = torch.zeros((N, T), dtype=torch.long)
        log_probs = torch.zeros((N, T), dtype=torch.float32)
        for i, e in enumerate(episodes):  # prompts left-padded, responses right-padded
            prompts[i, P - len(e.prompt):] = torch.tensor(e.prompt, dtype=torch.long)
            prompt_mask[i, P - len(e.prompt):] = 1
            t = len(e.tokens)
            responses[i, :t] = torch.tensor(e.tokens, dtype=torch.long)
            real[i, :t] = 1
            if e.finish != "error":  # an environment's failure is not the model's: not trained on
                model[i, :t] = torch.tensor(e.mask, dtype=torch.long)
            log_probs[i, :t] = torch.tensor(e.log_probs, dtype=torch.float32)
        attention_mask = torch.cat([prompt_mask, real], dim=1)  # [N, P+T]
        out["prompts"] = prompts  # [N, P]
        out["responses"] = responses  # [N, T]
        out["response_mask"] = model  # [N, T] 1 on model tokens only
        out["input_ids"] = torch.cat([prompts, responses], dim=1)  # [N, P+T]
        out["attention_mask"] = attention_mask
        out["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, P+T]
        out["rollout_log_probs"] = log_probs * model  # [N, T]
        if episodes and all(e.routes is not None for e in episodes):  # observations after the last turn: -1
            out["routed_experts"] = routes_as_rows([e.routes for e in episodes], [len(e.prompt) for e in episodes], P, T)
        fallback = getattr(runner.engine, "weight_version", -1)
        out["policy_version"] = torch.tensor([e.version if e.version is not None else fallback for e in episodes],
                                             dtype=torch.long)  # [N]
        out["response_text"] = [tokenizer.decode(e.tokens, skip_special_tokens=True) for e in episodes]
        out["finish_reason"] = [{"done": "stop", "error": "error"}.get(e.finish or "", "length") for e in episodes]
        out["env_reward"] = [0.0 if e.finish == "error" else float(sum(e.rewards)) for e in episodes]
        out["turn_rewards"] = [list(e.rewards) for e in episodes]
        out["env_turns"] = [len(e.turn_texts) for e in episodes]
        out["env_finish"] = [e.finish or "error" for e in episodes]
        out["env_error"] = [e.error or "" for e in episodes]
        out.temperature, out.rollout_metrics = sampling.temperature, {"rollout/gen_time_s": runner.gen_time_s}
        out.env_metrics = episode_metrics(episodes, runner, elapsed)
        return out


def episode_metrics(episodes: list[Episode], runner: _Runner, elapsed: float) -> dict[str, float]:
    """``env/*``: means per episode, counts per batch."""
    n = max(len(episodes), 1)
    metrics = {"env/turns_mean": sum(len(e.turn_texts) for e in episodes) / n,
               "env/episode_tokens_mean": sum(len(e.tokens) for e in episodes) / n,
               "env/model_tokens_mean": sum(sum(e.mask) for e in episodes) / n,
               "env/reward_mean": sum(sum(e.rewards) for e in episodes if e.finish != "error") / n,
               "env/tool_calls": float(sum(e.tool_calls for e in episodes)),
               "env/tool_errors": float(sum(e.tool_errors for e in episodes)),
               "env/requests": float(runner.requests), "timing_s/episodes": elapsed}
    for finish in FINISHES:
        metrics[f"env/{finish}" if finish == "error" else f"env/finish_{finish}"] = float(
            sum(e.finish == finish for e in episodes))
    metrics["env/errors"] = metrics.pop("env/error")
    return metrics


class _Inline:
    """``ThreadPoolExecutor.submit`` run at once in the calling thread."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
        return future


class SetupError(ValueError):
    """A multi-turn rollout cannot start (no chat template, a tool without a schema, ...)."""


class _Runner:
    """Runs one batch of episodes: environment calls in threads, generation requests from here."""

    def __init__(self, spec: MultiTurn, engine: RolloutEngine, sampling: SamplingParams, tokenizer: Any) -> None:
        self.spec, self.engine, self.sampling, self.tokenizer = spec, engine, sampling, tokenizer
        self.requests, self.gen_time_s = 0, 0.0
        self.chat: ChatFormat | None = None
        self.parser: Any = None
        self._chat_lock = threading.Lock()

    # -- the scheduler (controller thread) -------------------------------------------------------
    def run(self, episodes: list[Episode]) -> None:
        pool = self.spec.executor()
        env_calls: dict[Future, tuple[Episode, float]] = {}
        requests: dict[Future, list[Episode]] = {}
        ready: list[Episode] = []
        ready_since = 0.0
        position = {id(e): i for i, e in enumerate(episodes)}
        try:
            for e in episodes:
                env_calls[pool.submit(self._start, e)] = (e, time.perf_counter())
            while env_calls or requests or ready:
                now = time.perf_counter()
                if ready and (not env_calls or now - ready_since >= self.spec.batch_wait_s):
                    ready.sort(key=lambda e: position[id(e)])  # rows in the batch's order: a seed gives one run
                    requests.update(self._request(ready))
                    ready = []
                    continue
                timeout = self._timeout(ready, ready_since, env_calls, now)
                waiting = [*env_calls, *requests]
                done, _ = wait(waiting, timeout=timeout, return_when=FIRST_COMPLETED)
                for future in [f for f in waiting if f in done]:  # in submission order, not the set's
                    if future in requests:
                        for e, turn in zip(requests.pop(future), self._turns(future)):
                            env_calls[pool.submit(self._after_turn, e, *turn)] = (e, time.perf_counter())
                    else:
                        future.result()  # a setup error (no chat template, a tool without a schema) raises
                        e, _ = env_calls.pop(future)
                        if e.finish is None:
                            ready_since = ready_since if ready else time.perf_counter()
                            ready.append(e)
                self._expire(env_calls, episodes)
        finally:
            for future in env_calls:
                future.cancel()
            for e in episodes:
                if e.env is not None and not e.abandoned and callable(getattr(e.env, "close", None)):
                    self._guard(e, "close", e.env.close)

    def _timeout(self, ready: list[Episode], ready_since: float, env_calls: dict[Future, tuple[Episode, float]],
                 now: float) -> float | None:
        limits = [ready_since + self.spec.batch_wait_s - now] if ready else []
        if self.spec.env_timeout_s is not None and env_calls:
            limits.append(min(t for _, t in env_calls.values()) + self.spec.env_timeout_s - now)
        return max(min(limits), 0.0) if limits else None

    def _expire(self, env_calls: dict[Future, tuple[Episode, float]], episodes: list[Episode]) -> None:
        """End the episodes whose environment call ran past ``env_timeout_s``. Their thread may still
        change them, so the batch keeps a copy taken now."""
        if self.spec.env_timeout_s is None:
            return
        now = time.perf_counter()
        position = {id(e): i for i, e in enumerate(episodes)}
        for future, (e, started) in list(env_calls.items()):
            if now - started > self.spec.env_timeout_s and not future.done():
                del env_calls[future]
                e.abandoned = True
                tokens = list(e.tokens)
                snapshot = dataclasses.replace(e, tokens=tokens, mask=list(e.mask)[: len(tokens)],
                                               log_probs=list(e.log_probs)[: len(tokens)], rewards=list(e.rewards),
                                               turn_texts=list(e.turn_texts))
                snapshot.mask += [0] * (len(tokens) - len(snapshot.mask))
                snapshot.log_probs += [0.0] * (len(tokens) - len(snapshot.log_probs))
                self._fail(snapshot, "step", TimeoutError(f"an environment call ran past env_timeout_s="
                                                          f"{self.spec.env_timeout_s}s"))
                episodes[position[id(e)]] = snapshot

    def _request(self, ready: list[Episode]) -> dict[Future, list[Episode]]:
        """Send the ready episodes' contexts to the engine: one request per per-turn token limit."""
        groups: dict[int, list[Episode]] = {}
        for e in ready:
            budget = min(self.sampling.max_new_tokens, self.spec.max_episode_tokens - len(e.tokens))
            groups.setdefault(budget, []).append(e)
        out = {}
        for budget, group in groups.items():
            seed = None if self.sampling.seed is None else self.sampling.seed + 1_000_003 * self.requests
            params = dataclasses.replace(self.sampling, n=1, max_new_tokens=budget, seed=seed)
            future = self.engine.generate_async([e.prompt + e.tokens for e in group], params)
            future.version = self.engine.weight_version  # type: ignore[attr-defined]
            self.requests += 1
            out[future] = group
        return out

    def _turns(self, future: Future) -> list[tuple[list[int], list[float], bool, int, Any]]:
        """Each row of a finished request: its tokens, log-probs, whether it stopped, the version, and
        (a MoE policy's, recorded) the routes of its whole context and response."""
        gen = future.result()  # an engine's failure is the run's: it raises here
        self.gen_time_s += float(gen.metrics.get("gen_time_s", 0.0))
        version = gen.weight_version if gen.weight_version is not None else future.version  # type: ignore[attr-defined]
        lengths = gen.response_mask.sum(1).tolist()
        routes = gen.routed_experts or [None] * len(lengths)
        return [(gen.response_ids[i, :k].tolist(), gen.log_probs[i, :k].tolist(), gen.finish_reason[i] == "stop",
                 version, routes[i]) for i, k in enumerate(lengths)]

    # -- one episode (environment threads) ---------------------------------------------------------
    def _start(self, e: Episode) -> None:
        """Make the environment and render its first messages."""
        if not self._guard(e, "reset", self._reset, e):
            e.prompt = e.prompt or self._fallback_prompt(e.row)

    def _reset(self, e: Episode) -> None:
        e.env = self.spec.environment()
        e.tools = tool_methods(e.env)
        messages = as_messages(e.env.reset(e.row), f"{type(e.env).__name__}.reset")
        e.prompt = self._chat(e.tools).prompt(messages)

    def _after_turn(self, e: Episode, tokens: list[int], log_probs: list[float], stopped: bool, version: int,
                    routes: Any = None) -> None:
        """Append the model's turn; run its tool calls or ``step``; append the observation."""
        e.routes = routes  # the turn's request ran the whole episode so far: its routes cover it
        e.tokens += tokens
        e.mask += [1] * len(tokens)
        e.log_probs += log_probs
        e.version = version if e.version is None else min(e.version, version)
        self._guard(e, "step", self._observe, e, tokens, stopped)

    def _observe(self, e: Episode, tokens: list[int], stopped: bool) -> None:
        text = self.tokenizer.decode(tokens[:-1] if stopped else tokens, skip_special_tokens=False)
        e.turn_texts.append(text)
        calls = self.parser.parse(text) if e.tools and self.parser is not None else []
        if calls:
            messages = []
            for call in calls:
                content, failed = run_tool(call, e.tools)
                e.tool_calls += 1
                e.tool_errors += int(failed)
                messages.append({"role": "tool", "content": content})
            reward, done = 0.0, False
        else:
            result = as_step_result(e.env.step(text))
            messages = as_messages(result.messages, f"{type(e.env).__name__}.step")
            reward, done = float(result.reward), result.done
        e.rewards.append(reward)
        if done:
            e.finish = "done"
        elif len(e.turn_texts) >= self.spec.max_turns:
            e.finish = "max_turns"
        else:
            observation = self._chat(e.tools).observation(messages, stopped)
            if len(e.tokens) + len(observation) >= self.spec.max_episode_tokens:
                e.finish = "max_tokens"  # no room for the observation and another model token
            else:
                e.tokens += observation
                e.mask += [0] * len(observation)
                e.log_probs += [0.0] * len(observation)

    def _chat(self, tools: dict[str, Callable[..., Any]]) -> ChatFormat:
        """The chat format (built once per batch, with the tools' schemas of the first episode). What
        fails here is the setup's fault, not an episode's: it raises :class:`SetupError`."""
        with self._chat_lock:
            if self.chat is None:
                try:
                    self.chat = ChatFormat(self.tokenizer, tool_schemas(tools), self.spec.template_kwargs)
                    self.parser = parser_for(self.tokenizer, self.spec.tool_parser) if tools else None
                except Exception as exc:
                    raise SetupError(str(exc)) from exc
            return self.chat

    def _fallback_prompt(self, row: dict[str, Any]) -> list[int]:
        """A failed ``reset``'s row still needs a prompt: the dataset's, or one pad token."""
        ids = row.get("prompt_ids")
        return list(ids) if ids is not None and len(ids) else [self.tokenizer.pad_token_id]

    # -- failures --------------------------------------------------------------------------------
    def _guard(self, e: Episode, phase: str, fn: Callable[..., Any], *args: Any) -> bool:
        """``fn(*args)``; an exception ends the episode ``e`` (counted, logged once), not the run."""
        try:
            fn(*args)
            return True
        except SetupError:
            raise
        except Exception as exc:
            self._fail(e, phase, exc)
            return False

    def _fail(self, e: Episode, phase: str, exc: BaseException) -> None:
        if phase != "close":
            e.finish, e.error = "error", f"{phase}: {type(exc).__name__}: {exc}"
        name = type(e.env).__name__ if e.env is not None else getattr(self.spec.environment, "__name__", "environment")
        key = (name, phase, type(exc).__name__)
        with _LOG_LOCK:
            first = key not in _LOGGED
            _LOGGED.add(key)
        if first:  # later ones are counted in env/errors only
            log.warning("Environment %s raised in %s; the episode ends (counted in env/errors; further %s errors in "
                        "%s are not logged):\n%s", name, phase, type(exc).__name__, phase,
                        "".join(traceback.format_exception(exc)).rstrip())

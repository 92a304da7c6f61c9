"""Toy tasks on a CPU: the pieces the addition and guessing recipes are built from, for a task of
your own (sorting digits, reversing a number, a small game).

- :func:`char_tokenizer`: a tokenizer for a small alphabet, one token per character, with pad /
  bos / eos (and a chat template if asked); picklable, no downloads.
- :func:`tiny_model`: a tiny randomly initialised Qwen2 for that tokenizer.
- :class:`Problems`: problems from one seeded stream; the held-out set is drawn first and never
  drawn again for training.
- :func:`warm_up`: supervised (teacher-forced) warm-up on any ``(prompt, answer)`` generator, so
  that GRPO starts from a model that is sometimes right.
- :func:`exact_match` (a reward) and :func:`accuracy` (greedy exact match on held-out problems).
- :class:`ProblemsData`: the training and held-out prompts of :class:`Problems` as a data module,
  for a config file (``data: {class_path: rltrainer.toy.ProblemsData, init_args: {draw: my_task.draw,
  text: my_task.text}}``), so ``rltrainer fit`` / ``rltrainer validate`` run a toy task.

A whole new task in under 40 lines: ``.ci/docs/pages/new-task.md`` (the docs site's "A new task"). Nothing here is imported by
``import rltrainer``; ``from rltrainer import toy`` imports transformers only when a function needs it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F

from rltrainer.rollout.engine import SamplingParams
from rltrainer.rollout.hf import HFEngine
from rltrainer.testing import tiny_qwen2_config
from rltrainer.values import check_int

log = logging.getLogger(__name__)

P = TypeVar("P", bound=Hashable)
#: An answer: its text, or ``(text, learn)`` pieces (``learn=False``: context, not trained on).
Answer = str | Sequence[tuple[str, bool]]


# -- tokenizer and model ---------------------------------------------------------------------------
def char_tokenizer(alphabet: Iterable[str], pad: str = "<pad>", bos: str | None = "<bos>", eos: str = "<eos>",
                   unk: str | None = "<unk>", special_tokens: Sequence[str] = (),
                   chat_template: str | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet``.

    The ids are, in order: ``pad``, ``bos`` (``None``: none), ``eos``, ``special_tokens`` (each one
    token, e.g. chat markers), ``unk`` (``None``: a character outside the alphabet becomes ``pad``),
    then the alphabet's characters. ``tokenizer(text)`` starts with ``bos`` (``add_special_tokens=False``
    leaves it out), so prompts tokenised the usual way begin as the model saw them in
    :func:`warm_up`. ``decode`` joins characters without spaces. ``chat_template``
    (a Jinja template) is set only when given: a multi-turn environment needs one."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    specials = [t for t in (pad, bos, eos, *special_tokens, unk) if t is not None]
    if long := [c for c in chars if len(c) != 1]:
        raise ValueError(f"char_tokenizer: the alphabet must be single characters; got {long}. Pass multi-character "
                         "tokens as special_tokens=[...].")
    if (clash := sorted(set(chars) & set(specials))) or len(set(specials)) != len(specials):
        raise ValueError(f"char_tokenizer: the special tokens {specials} must be distinct and not characters of the "
                         f"alphabet {''.join(chars)!r} (in both: {clash}).")
    vocab = {token: i for i, token in enumerate([*specials, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk or pad))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()  # decode to "9590", not "9 5 9 0"
    if bos is not None:  # tokenizer(text) starts with bos, as a Llama tokenizer's does (add_special_tokens=False: not)
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                                          special_tokens=[(bos, vocab[bos])])
    kwargs = {"bos_token": bos} if bos is not None else {}
    if unk is not None:
        kwargs["unk_token"] = unk
    if special_tokens:
        kwargs["additional_special_tokens"] = list(special_tokens)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token=eos, **kwargs)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def tiny_model(tokenizer: Any, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
               num_kv_heads: int | None = None, max_positions: int = 64, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised tiny Qwen2 (:func:`rltrainer.testing.tiny_qwen2_config`) for
    ``tokenizer``'s vocabulary, its weights drawn after ``torch.manual_seed(seed)``;
    ``num_kv_heads`` defaults to half the heads."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(
        len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads or max(1, num_heads // 2), max_positions=max_positions, **overrides))


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """``prompt``'s ids as the model sees them: ``bos`` first if the tokenizer has one."""
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    return ids if tokenizer.bos_token_id is None else [tokenizer.bos_token_id, *ids]


# -- problems --------------------------------------------------------------------------------------
class Problems(Generic[P]):
    """Problems from one seeded stream. ``draw(rng)`` makes one problem (anything hashable and
    sortable: ``(42, 917)``, ``"3141"``); ``text(problem)`` is its ``(prompt, answer)``. The
    ``num_val`` held-out problems (:attr:`val`) are drawn first and never returned by :meth:`sample`."""

    def __init__(self, draw: Callable[[random.Random], P], text: Callable[[P], tuple[str, str]], num_val: int,
                 seed: int = 0) -> None:
        self.draw, self.text, self.rng = draw, text, random.Random(seed)
        self.val: set[P] = set()
        self.val = set(self.sample(num_val))

    def sample(self, n: int, draw: Callable[[random.Random], P] | None = None) -> list[P]:
        """``n`` distinct problems, none held out, sorted (one order for a seed, whatever the
        hashing); ``draw`` replaces the stream's own for this call (a warm-up mix)."""
        draw = draw or self.draw
        out: set[P] = set()
        tries = 0
        while len(out) < n:
            tries += 1
            if tries > 100 * n + 10_000:
                raise ValueError(f"Problems.sample({n}): only {len(out)} distinct problems that are not held out "
                                 f"came from {tries - 1} draws ({len(self.val)} are held out). Ask for fewer, hold "
                                 "out fewer (num_val), or make draw() cover more problems.")
            problem = draw(self.rng)
            if problem not in self.val:
                out.add(problem)
        return sorted(out)

    def held_out(self) -> list[tuple[str, str]]:
        """The held-out problems as ``(prompt, answer)`` texts, sorted."""
        return self.texts(sorted(self.val))

    def texts(self, problems: Iterable[P]) -> list[tuple[str, str]]:
        return [self.text(p) for p in problems]

    def rows(self, problems: Iterable[P], tokenizer: Any) -> list[dict[str, Any]]:
        """Dataset rows for :func:`rltrainer.prompt_dataloader`: ``prompt_ids`` (``bos`` + the
        prompt) and the ``answer`` text (what :func:`exact_match` reads)."""
        return [{"prompt_ids": encode_prompt(tokenizer, prompt), "answer": answer}
                for prompt, answer in self.texts(problems)]


class ProblemsData:
    """A data module of :class:`Problems` (``Problems(draw, text, num_val, seed)``): ``num_train``
    training prompts and the ``num_val`` held-out ones, as rows :meth:`Problems.rows` makes
    (``prompt_ids``, ``bos`` first as :func:`warm_up` saw them, and the ``answer`` :func:`exact_match`
    reads). For the command line: ``draw`` and ``text`` are dotted paths in the config
    (``my_task.draw``), the tokenizer is the module's (``setup(tokenizer)``); with the same ``draw``,
    ``text``, ``num_val`` and ``seed`` as a warm-up's :class:`Problems`, the held-out set is the
    same, never trained on by either."""

    def __init__(self, draw: Callable[..., Any], text: Callable[..., Any], num_train: int = 2400, num_val: int = 300,
                 seed: int = 0, batch_size: int = 16, val_batch_size: int = 256) -> None:
        for name, value in (("num_train", num_train), ("num_val", num_val), ("batch_size", batch_size),
                            ("val_batch_size", val_batch_size)):
            check_int(name, value, at_least=1, owner="ProblemsData")
        check_int("seed", seed, owner="ProblemsData")
        self.problems = Problems(draw, text, num_val, seed)
        self.num_train, self.seed, self.batch_size, self.val_batch_size = num_train, seed, batch_size, val_batch_size
        self.tokenizer: Any = None

    def setup(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def train_dataloader(self) -> Any:
        from rltrainer.data import prompt_dataloader

        problems = self.problems.sample(self.num_train)
        return prompt_dataloader(self.problems.rows(problems, self._tokenizer()), self.batch_size, seed=self.seed)

    def val_dataloader(self) -> Any:
        from rltrainer.data import prompt_dataloader

        rows = self.problems.rows(sorted(self.problems.val), self._tokenizer())
        return prompt_dataloader(rows, self.val_batch_size, shuffle=False, drop_last=False)

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise RuntimeError("ProblemsData.setup(tokenizer) must be called before its dataloaders are built (the "
                               "command line calls it with the module's tokenizer)")
        return self.tokenizer


def exact_match(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """A reward: 1.0 if the completion (surrounding spaces stripped) is exactly the answer, else 0.0."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


# -- supervised warm-up ----------------------------------------------------------------------------
@dataclasses.dataclass
class WarmUp:
    """What :func:`warm_up` did: the ``model`` (in eval mode), the ``steps`` taken, the last batch's
    ``loss``, the windowed greedy ``exact`` rate and ``position_accuracy`` (one per answer token,
    the final ``eos`` aside), whether the target was ``reached``, and ``path`` if it saved."""

    model: torch.nn.Module
    steps: int
    loss: float
    exact: float
    position_accuracy: list[float]
    reached: bool
    path: Path | None = None


def warm_up(model: torch.nn.Module, tokenizer: Any, sample: Callable[[int], Sequence[tuple[str, Answer]]],
            steps: int = 300, batch_size: int = 64, lr: float = 3e-3, weight_decay: float = 0.01,
            target_exact: float | None = None, min_position_accuracy: float = 0.0, window: int = 10,
            counted: Callable[[str, Answer], bool] | None = None, save_to: str | Path | None = None) -> WarmUp:
    """Teacher-forced cross-entropy on the answers of ``sample(batch_size)`` (a list of ``(prompt,
    answer)``), with AdamW, for at most ``steps`` steps. Every answer gets ``eos``; an answer may be
    ``(text, learn)`` pieces, where ``learn=False`` pieces (an environment's replies) are context only.

    Greedy decoding gets a problem right exactly when every teacher-forced argmax is its target, so
    that is what is counted, on each batch before its update (on the problems ``counted(prompt,
    answer)`` accepts; default all). With ``target_exact``, it stops once, over the last ``window``
    batches, that share is exactly right *and* every answer position (``eos`` aside) is right on at
    least ``min_position_accuracy`` of them: stop *partly* trained, so that GRPO has something to
    learn and a signal to learn it from. ``save_to``: ``save_pretrained`` the model (and the
    tokenizer) there, for ``GRPO(model=path)``."""
    if bad := [f"{k}={v!r}" for k, v in (("steps", steps), ("batch_size", batch_size), ("window", window))
               if not isinstance(v, int) or v < 1]:
        raise ValueError(f"warm_up needs positive ints; got {', '.join(bad)}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    recent: list[torch.Tensor] = []  # per batch: [T-1] position accuracies, then the exact-match rate
    exact, positions, loss_value, reached, step = 0.0, torch.zeros(0), float("nan"), False, 0
    for step in range(1, steps + 1):
        examples = list(sample(batch_size))
        ids, targets, P, padded = _teacher_forcing_batch(examples, tokenizer)  # [B, P+T], [B, T]
        kwargs = {} if padded is None else {"attention_mask": padded,
                                            "position_ids": (padded.cumsum(-1) - 1).clamp(min=0)}
        logits = model(input_ids=ids, **kwargs).logits[:, P - 1 : -1]  # [B, T, V]: position P-1+t predicts token t
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_value = loss.item()
        keep = torch.tensor([counted is None or counted(p, a) for p, a in examples])
        learn = (targets != -100)[keep]  # [B', T]
        hits = (logits.argmax(-1) == targets)[keep]  # [B', T]
        recent = (recent + [_batch_rates(hits, learn)])[-window:]
        mean = torch.stack(recent).mean(0)  # [T + 1]
        positions, exact = mean[:-2], mean[-1].item()  # the answer's positions without eos; the exact rate
        if target_exact is not None and len(recent) == window and exact >= target_exact \
                and positions.min() >= min_position_accuracy:
            reached = True
            break
    if target_exact is not None and not reached:
        log.warning("warm_up: the target (%.0f%% exact, every position %.0f%% right) was not reached in %d steps "
                    "(reached %.1f%% exact, positions %s); GRPO may get little signal. Raise steps or lr.",
                    100 * target_exact, 100 * min_position_accuracy, step, 100 * exact,
                    [round(v, 2) for v in positions.tolist()])
    result = WarmUp(model.eval(), step, loss_value, exact, [round(v, 2) for v in positions.tolist()], reached)
    if save_to is not None:
        result.path = Path(save_to)
        model.save_pretrained(result.path)
        tokenizer.save_pretrained(result.path)
    return result


def _teacher_forcing_batch(examples: Sequence[tuple[str, Answer]], tokenizer: Any
                           ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """``ids [B, P+T]`` (prompts left-padded, answers + eos right-padded), ``targets [B, T]`` (-100
    on padding and on pieces not learned), ``P``, and the attention mask if anything is padded."""
    prompts, answers, learned = [], [], []
    for prompt, answer in examples:
        pieces = [(answer, True)] if isinstance(answer, str) else list(answer)
        tokens, learn = [], []
        for text, flag in pieces:
            piece = tokenizer(text, add_special_tokens=False).input_ids
            tokens += piece
            learn += [flag] * len(piece)
        prompts.append(encode_prompt(tokenizer, prompt))
        answers.append(tokens + [tokenizer.eos_token_id])
        learned.append(learn + [True])
    P, T = max(map(len, prompts)), max(map(len, answers))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (P - len(p)) + p + a + [pad] * (T - len(a)) for p, a in zip(prompts, answers)])
    targets = torch.tensor([[t if ok else -100 for t, ok in zip(a, m)] + [-100] * (T - len(a))
                            for a, m in zip(answers, learned)])
    if all(len(p) == P for p in prompts) and all(len(a) == T for a in answers):
        return ids, targets, P, None
    mask = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(a)) + [0] * (T - len(a))
                         for p, a in zip(prompts, answers)])
    return ids, targets, P, mask


def _batch_rates(hits: torch.Tensor, learn: torch.Tensor) -> torch.Tensor:
    """``[T + 1]``: each answer position's accuracy over the rows that learn it, then the share of
    rows right at every learned position."""
    if bool(learn.all()):  # the usual case: plain means
        return torch.cat([hits.float().mean(0), hits.all(-1).float().mean().view(1)])
    per_position = (hits & learn).float().sum(0) / learn.float().sum(0).clamp(min=1)
    return torch.cat([per_position, (hits | ~learn).all(-1).float().mean().view(1)])


# -- held-out evaluation ---------------------------------------------------------------------------
def accuracy(model: Any, tokenizer: Any, problems: Sequence[tuple[str, str]], max_new_tokens: int | None = None,
             batch_size: int = 256) -> float:
    """Greedy exact-match accuracy on ``problems`` (``(prompt, answer)`` texts, e.g.
    :meth:`Problems.held_out`): the share whose greedy completion, up to ``eos``, is the answer.

    ``model``: a transformers causal LM (after :func:`warm_up`), or a :class:`~rltrainer.Trainer`
    after ``fit`` and before ``teardown`` (its engine, with the policy's current weights: any
    strategy, any engine). ``max_new_tokens`` defaults to the longest answer's tokens plus ``eos``."""
    if not problems:
        raise ValueError("accuracy() needs at least one (prompt, answer) problem; got none")
    engine = _engine(model, tokenizer)
    if max_new_tokens is None:
        max_new_tokens = max(len(tokenizer(a, add_special_tokens=False).input_ids) for _, a in problems) + 1
    sampling = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=0.0)
    right = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        gen = engine.generate([encode_prompt(tokenizer, p) for p, _ in chunk], sampling)
        right += sum(exact_match(list(gen.text), [a for _, a in chunk]))
    return right / len(problems)


def _engine(model: Any, tokenizer: Any) -> Any:
    """The trainer's engine (weights synced, awake), or an ``hf`` engine holding ``model``'s weights."""
    if hasattr(model, "sync") and hasattr(model, "engine"):  # a Trainer
        if model.sync is None:  # set up by fit() or validate(), until teardown()
            raise ValueError("accuracy(trainer, ...) needs the trainer's engine: call it after fit() or validate() "
                             "and before teardown(), or pass the model itself.")
        model.sync.push(model.global_step, mode="wait")
        model.engine.wake_up()
        return model.engine
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"accuracy() takes a transformers model or a Trainer; got {type(model).__name__}")
    engine = HFEngine()
    engine.setup(model.config, tokenizer)
    engine.update_weights(model.state_dict().items())
    return engine

"""``LearningSignal``: a run that cannot learn says so within a few steps, instead of running on in
silence (60 steps of reward 0.0 looked like any other run).

What it watches, each cause warned once (a logged WARNING naming the cause and what to check):

- every response empty (``response/empty_ratio`` 1.0) for ``patience`` steps in a row;
- every reward identical (``critic/score/max == critic/score/min``, e.g. all 0.0) for ``patience`` steps;
- every group without signal (``critic/groups/zero_std_ratio`` 1.0, all samples of each prompt scored
  alike, so every group-baseline advantage is 0) for ``patience`` steps, with ``G >= 2``;
- prompts holding the tokenizer's unknown token (its ``unk_token``, the unknown token of its model,
  or the pad token inside a prompt), or decoding to the replacement character ``\\ufffd``; and prompts
  without the start token the tokenizer itself adds (``bos_token``), from the first step on (single-turn:
  a multi-turn environment builds its prompts itself).

The Trainer adds one with ``patience=3`` unless ``callbacks`` holds one; ``LearningSignal(patience=0)``
turns it off. Its warnings are kept (:attr:`LearningSignal.warnings`): the command line repeats them in
the run's closing summary, and a progress bar prints them on lines of their own. The loop logs the
metrics it reads (:func:`signal_metrics`) on every step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.algorithms.advantages import group_index, group_signal_metrics
from rltrainer.callbacks.callback import Callback
from rltrainer.values import check_int

if TYPE_CHECKING:
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer

log = logging.getLogger(__name__)

#: prompt rows decoded to look for the replacement character (the first batch only)
DECODED_ROWS = 8


def signal_metrics(batch: RolloutBatch) -> dict[str, float]:
    """``response/empty_ratio`` (rows whose response text is blank, or that have no response token),
    ``critic/score/{max,min}`` and, for groups of two or more, ``critic/groups/zero_std_ratio``."""
    out: dict[str, float] = {}
    if "response_text" in batch:
        out["response/empty_ratio"] = sum(not str(t).strip() for t in batch["response_text"]) / max(len(batch), 1)
    elif "response_mask" in batch:
        out["response/empty_ratio"] = (batch["response_mask"].sum(-1) == 0).float().mean().item()
    if "scores" in batch and len(batch):
        scores = batch["scores"].float()  # [N]
        out["critic/score/max"], out["critic/score/min"] = scores.max().item(), scores.min().item()
        if "uid" in batch and torch.bincount(group_index(batch["uid"])).min() >= 2:
            out.update({k: v for k, v in group_signal_metrics(scores, batch["uid"]).items() if "zero_std" in k})
    return out


class LearningSignal(Callback):
    """Warn once per cause when the run shows no learning signal (see the module docstring).

    Args:
        patience: steps in a row a cause must hold before the warning (``0``: never warn).
    """

    def __init__(self, patience: int = 3) -> None:
        self.patience = check_int("patience", patience, at_least=0, meaning="steps in a row; 0: off",
                                  owner="LearningSignal")
        self.streaks: dict[str, int] = {}
        self.warned: set[str] = set()
        self.warnings: list[str] = []  # what it warned, in order (the CLI's summary repeats them)
        self._decoded = False

    def on_step_start(self, trainer: Trainer, module: RLModule, batch: RolloutBatch) -> None:
        tokenizer = getattr(module, "tokenizer", None)
        if not self.patience or tokenizer is None or "prompt_ids" not in batch or module.environment is not None:
            return  # a multi-turn environment makes its prompts itself (reset): prompt_ids are not what the model sees
        prompts = [list(map(int, ids)) for ids in batch["prompt_ids"]]
        if "unknown_tokens" not in self.warned:
            self._check_unknown(tokenizer, prompts)
        if "no_start_token" not in self.warned:
            self._check_start(tokenizer, prompts)

    def on_step_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        if not self.patience:
            return
        group_size = getattr(getattr(module, "sampling", None), "n", 1)
        same = metrics.get("critic/score/max") is not None and metrics.get("critic/score/max") == metrics.get(
            "critic/score/min")
        causes = {
            "empty_responses": metrics.get("response/empty_ratio", 0.0) >= 1.0,
            "identical_rewards": same,
            "no_group_signal": group_size >= 2 and not same and metrics.get("critic/groups/zero_std_ratio", 0.0) >= 1.0,
        }
        for cause, holds in causes.items():
            self.streaks[cause] = self.streaks.get(cause, 0) + 1 if holds else 0
            if self.streaks[cause] >= self.patience and cause not in self.warned:
                self.warned.add(cause)
                self._warn(self._message(cause, metrics, trainer.global_step))

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        log.warning(message)

    def _message(self, cause: str, metrics: dict[str, float], step: int) -> str:
        steps = f"the last {self.streaks[cause]} steps (up to step {step})"
        if cause == "empty_responses":
            return (f"No learning signal: every response was empty in {steps}, so no reward can tell them apart. "
                    f"Check that the prompt tokenises to tokens the model knows (see any warning about unknown "
                    f"tokens above), that it starts and ends as in the model's training (start token, chat template), "
                    f"the stop tokens / EOS, and max_new_tokens; look at the samples in generations.jsonl.")
        if cause == "identical_rewards":
            return (f"No learning signal: every reward was {metrics.get('critic/score/max')} in {steps}, so every "
                    f"advantage is 0 and the policy does not move toward anything. Check the reward function on a few "
                    f"responses by hand (the answer format it parses, the dataset column it compares with), and the "
                    f"responses themselves (generations.jsonl).")
        return (f"No learning signal: in {steps} every group's samples scored alike (critic/groups/zero_std_ratio 1.0), "
                f"so every group-baseline advantage is 0. The prompts are all too hard or all too easy for the policy "
                f"(critic/groups/solve_none_ratio, solve_all_ratio say which): try easier prompts or a warm-up, more "
                f"samples per prompt (num_generations), a higher temperature, or a reward with partial credit.")

    def _check_unknown(self, tokenizer: Any, prompts: list[list[int]]) -> None:
        unknown = unknown_ids(tokenizer)
        hits = [(row, sum(i in unknown for i in ids)) for row, ids in enumerate(prompts)]
        bad = [(row, n) for row, n in hits if n]
        decoded = "" if self._decoded else next(
            (text for text in (safe_decode(tokenizer, ids) for ids in prompts[:DECODED_ROWS]) if "\ufffd" in text), "")
        self._decoded = True
        if not bad and not decoded:
            return
        self.warned.add("unknown_tokens")
        total = sum(len(ids) for ids in prompts)
        what = (f"{sum(n for _, n in bad)} of the {total} prompt tokens of this step are the tokenizer's unknown token "
                f"(ids {sorted(unknown)}; row {bad[0][0]} decodes to {safe_decode(tokenizer, prompts[bad[0][0]])[:80]!r})"
                if bad else f"a prompt decodes to the replacement character: {decoded[:80]!r}")
        self._warn(f"The model cannot read its prompts: {what}. The tokenizer cannot encode part of the prompt text "
                   "(an instruction or template with characters outside its vocabulary?). Check the dataset's prompt "
                   "column and the data format (the CLI's gsm8k format adds an instruction), and tokenise with the "
                   "model's own tokenizer.")

    def _check_start(self, tokenizer: Any, prompts: list[list[int]]) -> None:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None or not prompts or not adds_start_token(tokenizer, bos):
            return
        missing = sum(not ids or ids[0] != bos for ids in prompts)
        if missing:
            self.warned.add("no_start_token")
            self._warn(f"{missing} of {len(prompts)} prompts do not start with the start token "
                       f"{getattr(tokenizer, 'bos_token', None)!r} (id {bos}), which the tokenizer adds to text it "
                       "encodes, so the model saw it first in training. Tokenise the prompts with the tokenizer's "
                       "defaults (add_special_tokens=True) or prepend it.")


def unknown_ids(tokenizer: Any) -> set[int]:
    """Ids that stand for text the tokenizer could not encode: its ``unk_token_id``, its model's
    unknown token (a ``tokenizers`` WordLevel/BPE ``unk_token``), and its pad token when that is not EOS
    (a pad inside an unpadded prompt is an unknown character mapped to it, as a vocabulary without
    an ``<unk>`` of its own does)."""
    ids = {getattr(tokenizer, "unk_token_id", None)}
    model_unk = getattr(getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None), "unk_token", None)
    if model_unk:
        ids.add(tokenizer.convert_tokens_to_ids(model_unk))
    pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if pad is not None and pad != eos:
        ids.add(pad)
    return {int(i) for i in ids if i is not None}


def adds_start_token(tokenizer: Any, bos: int) -> bool:
    try:
        return tokenizer("a")["input_ids"][:1] == [bos]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode: nothing to compare with
        return False


def safe_decode(tokenizer: Any, ids: list[int]) -> str:
    try:
        return str(tokenizer.decode(ids))
    except Exception:  # noqa: BLE001 - ids the tokenizer cannot decode back
        return "\ufffd"

"""Load prompt datasets and turn them into rows the Trainer takes.

The row contract: a row needs ``prompt_ids`` (``list[int]``, the prompt's token ids); every other
column travels with it through the rollout and reaches the reward functions as a keyword argument
holding a list aligned with the completions. :func:`prepare_prompts` builds such rows from any
dataset, keeping every column:

==================  ===========  ==============================================================
column              type         meaning
==================  ===========  ==============================================================
``prompt``          str          the full prompt text (chat template + generation prompt applied)
``prompt_ids``      list[int]    ``prompt`` tokenised without adding special tokens
(every other)       any          as in the source rows
==================  ===========  ==============================================================

:func:`prepare_gsm8k` / :func:`prepare_math500` are thin uses of it that also add
``question`` (the raw question text) and ``ground_truth`` (the gold answer, as the rewards in
``rltrainer.rewards`` expect).

Prompts longer than ``max_prompt_length`` tokens are dropped, never truncated: a truncated
question has a different answer. Example::

    rows = load_rows("recipes/data/gsm8k/train.jsonl")
    train = prepare_gsm8k(rows, tokenizer, max_prompt_length=256)
    mine = prepare_prompts(load_rows("mine.jsonl"), tokenizer, prompt_column="problem")
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltrainer.values import check_int

if TYPE_CHECKING:  # `datasets` is imported where used: it is slow to import
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

# Maps one row (and its index, for error messages) to (question text, ground truth).
RowParser = Callable[[Mapping[str, Any], int], tuple[str, str]]


def load_rows(source: str, split: str = "train", data_files: str | Sequence[str] | None = None) -> Dataset:
    """Load raw rows from a local file or directory, or from the Hugging Face Hub.

    Args:
        source: a ``.jsonl``/``.json``/``.parquet`` file; a directory holding
            ``<split>.jsonl``/``<split>.json``/``<split>.parquet``; or a Hub dataset name
            (needs network access; set ``HF_HUB_OFFLINE=1`` to fail fast without one).
        split: the split to read from a directory or from the Hub.
        data_files: explicit files, resolved relative to ``source`` when it is a directory
            (otherwise passed to the Hub loader).
    """
    import datasets

    path = Path(source).expanduser()
    if path.is_dir() and data_files is not None:
        names = [data_files] if isinstance(data_files, str) else list(data_files)
        return _load_local([path / name for name in names])
    if path.is_file():
        return _load_local([path])
    if path.is_dir():
        candidates = [path / f"{split}{suffix}" for suffix in LOCAL_FORMATS]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise FileNotFoundError(
                f"Directory {str(path)!r} has no file for split {split!r}; looked for "
                f"{[c.name for c in candidates]}, found {sorted(p.name for p in path.iterdir())}."
            )
        return _load_local(found[:1])
    if path.suffix in LOCAL_FORMATS or path.is_absolute() or source.startswith((".", "~")):
        raise FileNotFoundError(f"Dataset file {source!r} does not exist (resolved to {str(path.resolve())!r}).")
    try:
        return datasets.load_dataset(source, split=split, data_files=data_files)
    except Exception as error:
        raise RuntimeError(
            f"Could not load {source!r} (split {split!r}) from the Hugging Face Hub: {error}. "
            f"If this machine is offline, pass a local file or directory instead: accepted formats are "
            f"{sorted(LOCAL_FORMATS)} files, or a directory with '<split>.jsonl', '<split>.json' or "
            "'<split>.parquet'."
        ) from error


def _load_local(paths: Sequence[Path]) -> Dataset:
    """Read local files of one format with ``datasets.load_dataset("json" | "parquet")``."""
    import datasets

    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"Dataset file {str(p)!r} does not exist.")
    formats = {LOCAL_FORMATS.get(p.suffix) for p in paths}
    if None in formats or len(formats) != 1:
        raise ValueError(
            f"Cannot read {[str(p) for p in paths]}: all files must share one of the formats "
            f"{sorted(LOCAL_FORMATS)}."
        )
    kind = formats.pop()
    try:
        return datasets.load_dataset(kind, data_files=[str(p) for p in paths], split="train")
    except Exception:
        if kind == "json":
            for p in paths:  # name the file and line instead of "An error occurred while generating the dataset"
                check_json_lines(p)
        raise


def check_json_lines(path: Path) -> None:
    """Raise ``ValueError`` naming ``path`` and the first line of a ``.jsonl`` file that is not one
    JSON object (a ``.json`` file must parse as a whole). Called when ``datasets`` fails to read it."""
    import json

    with path.open(encoding="utf-8", errors="replace") as f:
        if path.suffix == ".json":
            text = f.read()
            try:
                json.loads(text)
                return
            except json.JSONDecodeError as error:
                if text.lstrip().startswith("["):
                    raise ValueError(f"{str(path)!r}, line {error.lineno}, column {error.colno}: not valid JSON "
                                     f"({error.msg}). Fix that line, or delete it.") from None
            f.seek(0)  # a .json file may hold JSON lines too
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.strip())
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{str(path)!r}, line {number}: not valid JSON ({error.msg} at column {error.colno}): "
                    f"{line.strip()[:80]!r}. Each line of a JSON Lines file must be one JSON object; fix or "
                    "delete that line.") from None
            if not isinstance(row, dict):
                raise ValueError(f"{str(path)!r}, line {number}: a JSON {type(row).__name__}, not an object "
                                 f"({line.strip()[:80]!r}); each line must be one JSON object like "
                                 '{"question": ..., "answer": ...}.')


def gsm8k_row(row: Mapping[str, Any], index: int) -> tuple[str, str]:
    """GSM8K ``question``/``answer`` -> (question, gold number after ``####`` without ``,``)."""
    question, answer = _require(row, index, "GSM8K", ("question", "answer"))
    if "####" not in answer:
        raise ValueError(
            f"GSM8K row {index} has an answer without a final '#### <number>' line: {answer[-80:]!r}; "
            f"fields found: {_fields(row)}."
        )
    gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not gold:
        raise ValueError(f"GSM8K row {index} has nothing after '####' in its answer; fields found: {_fields(row)}.")
    return question, gold


def math500_row(row: Mapping[str, Any], index: int) -> tuple[str, str]:
    """MATH-500 ``problem``/``answer`` -> (problem, answer)."""
    problem, answer = _require(row, index, "MATH-500", ("problem", "answer"))
    return problem, answer


def _fields(row: Mapping[str, Any]) -> list[str]:
    return [key for key, value in row.items() if value is not None]


def _require(row: Mapping[str, Any], index: int, name: str, keys: Sequence[str]) -> list[str]:
    """The string values of ``keys`` in ``row``; a missing or ``None`` field raises with the row index."""
    values = []
    for key in keys:
        value = row.get(key)
        if value is None:
            raise ValueError(f"{name} row {index} has no field {key!r}; fields found: {_fields(row)}.")
        values.append(str(value))
    return values


def build_prompt(
    question: str,
    tokenizer: PreTrainedTokenizerBase,
    instruction: str | None = None,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> str:
    """The prompt text for one question: the chat template with a generation prompt when the
    tokenizer has one and ``use_chat_template``, else ``system_prompt\\n\\nquestion instruction``."""
    content = f"{question} {instruction}" if instruction else question
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": content})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n\n{content}" if system_prompt else content


def build_chat_prompt(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    index: int,
    system_prompt: str | None = None,
) -> str:
    """The prompt text for one conversation (``[{"role", "content"}, ...]``): the chat template with
    a generation prompt; ``system_prompt`` goes first unless the conversation has a system turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"Row {index} holds chat messages, but the tokenizer has no chat_template to render them; "
                         "use a tokenizer with one, or a column of plain prompt strings.")
    bad = [m for m in messages if not isinstance(m, Mapping) or "role" not in m or "content" not in m]
    if bad:
        raise ValueError(f"Row {index}: every chat message needs 'role' and 'content'; got {_preview(bad[0])}.")
    turns = [dict(m) for m in messages]
    if system_prompt and not any(m["role"] == "system" for m in turns):
        turns.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def prepare_prompts(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    prompt_column: str = "prompt",
    max_prompt_length: int | None = 512,
    instruction: str | None = None,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
    return_dropped: bool = False,
) -> Dataset | tuple[Dataset, int]:
    """Tokenised prompts from any dataset, every column kept: the rows :func:`prompt_dataloader`
    and the reward functions take.

    Each row gets ``prompt`` (the text the model sees: the chat template with a generation prompt)
    and ``prompt_ids`` (``prompt`` tokenised without adding special tokens); every other column
    stays as it is and reaches the reward functions as a keyword argument (``answer=[...]``).

    Args:
        dataset: raw rows (a :class:`datasets.Dataset`, e.g. from :func:`load_rows`).
        tokenizer: a Hugging Face tokenizer; its chat template is used when it has one.
        prompt_column: the column the prompt comes from: a string (the user turn; ``instruction``
            is appended and the chat template applied) or a chat conversation, a list of
            ``{"role", "content"}`` messages (TRL's conversational format, e.g. ``"messages"``), which
            is rendered as it is. A source column named ``prompt`` is replaced by its rendered text.
        max_prompt_length: drop (never truncate) prompts with more tokens than this; ``None`` keeps all.
        instruction: appended to a string prompt after a space.
        system_prompt: an optional system message (not added to a conversation that has one).
        use_chat_template: ``False`` gives plain ``prompt instruction`` text for string prompts.
        return_dropped: also return the number of dropped prompts.

    Returns:
        The prepared dataset, or ``(dataset, n_dropped)`` when ``return_dropped``.
    """
    check_int("max_prompt_length", max_prompt_length, at_least=1, none="keep all", meaning="tokens")
    if prompt_column not in dataset.column_names:
        raise ValueError(f"prepare_prompts(prompt_column={prompt_column!r}): the dataset has no such column; its "
                         f"columns are {dataset.column_names}. Pass the column that holds the prompt (a string, or a "
                         "list of chat messages), e.g. prompt_column='question' or prompt_column='messages'.")

    def render(value: Any, index: int) -> str:
        if isinstance(value, str):
            return build_prompt(value, tokenizer, instruction, system_prompt, use_chat_template)
        if isinstance(value, Sequence) and value:
            return build_chat_prompt(value, tokenizer, index, system_prompt)
        raise ValueError(f"Row {index}: column {prompt_column!r} must hold a string or a non-empty list of chat "
                         f"messages; got {type(value).__name__} {_preview(value)}.")

    templated = use_chat_template and bool(getattr(tokenizer, "chat_template", None))

    def to_prompts(values: list[Any], indices: list[int]) -> dict[str, list[Any]]:
        prompts = [render(value, index) for value, index in zip(values, indices)]
        # A chat template writes the start token itself; plain text gets the tokenizer's own (a bos
        # the model was trained to see first), as tokenizer(text) would add it.
        plain = [isinstance(value, str) and not templated for value in values]
        prompt_ids: list[list[int]] = [[] for _ in prompts]
        for special in (False, True):
            rows = [i for i, flag in enumerate(plain) if flag == special]
            if rows:
                encoded = tokenizer([prompts[i] for i in rows], add_special_tokens=special)["input_ids"]
                for i, ids in zip(rows, encoded):
                    prompt_ids[i] = list(ids)
        return {"prompt": prompts, "prompt_ids": prompt_ids}

    from datasets.fingerprint import generate_random_fingerprint

    prepared = dataset.map(
        to_prompts,
        batched=True,
        with_indices=True,
        input_columns=prompt_column,
        keep_in_memory=True,  # small, and avoids hashing the tokenizer for the cache key
        new_fingerprint=generate_random_fingerprint(),
        desc="Tokenizing prompts",
    )
    prepared, n_dropped = filter_long_prompts(prepared, max_prompt_length)
    return (prepared, n_dropped) if return_dropped else prepared


def parse_rows(dataset: Dataset, parse_row: RowParser) -> Dataset:
    """``dataset`` with ``question`` and ``ground_truth`` set from ``parse_row(row, index)`` (which
    raises ``ValueError`` on a bad row); every other column kept."""
    columns = list(dataset.column_names)

    def parse(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        rows = [{key: batch[key][i] for key in columns} for i in range(len(indices))]
        parsed = [parse_row(row, index) for row, index in zip(rows, indices)]
        return {"question": [q for q, _ in parsed], "ground_truth": [truth for _, truth in parsed]}

    from datasets.fingerprint import generate_random_fingerprint

    return dataset.map(parse, batched=True, with_indices=True, keep_in_memory=True,
                       new_fingerprint=generate_random_fingerprint(), desc="Reading questions and answers")


def filter_long_prompts(dataset: Dataset, max_prompt_length: int | None) -> tuple[Dataset, int]:
    """Drop rows whose ``prompt_ids`` has more than ``max_prompt_length`` tokens (never truncate).

    Returns:
        ``(kept_rows, n_dropped)``; the drop count is also logged.
    """
    if max_prompt_length is None:
        return dataset, 0
    if "prompt_ids" not in dataset.column_names:
        raise ValueError(
            f"filter_long_prompts needs a 'prompt_ids' column; the dataset has {dataset.column_names}."
        )
    kept = dataset.filter(
        lambda ids: [len(x) <= max_prompt_length for x in ids],
        input_columns="prompt_ids",
        batched=True,
        keep_in_memory=True,
        desc=f"Dropping prompts longer than {max_prompt_length} tokens",
    )
    n_dropped = len(dataset) - len(kept)
    level = logging.WARNING if n_dropped else logging.INFO
    logger.log(level, "Dropped %d of %d prompts longer than %d tokens", n_dropped, len(dataset), max_prompt_length)
    return kept, n_dropped


def prepare_gsm8k(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int | None = 512,
    instruction: str = GSM8K_INSTRUCTION,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
    return_dropped: bool = False,
) -> Dataset | tuple[Dataset, int]:
    """GSM8K rows (``question``, ``answer``) -> :func:`prepare_prompts` rows from ``question``, plus
    ``ground_truth``; every column kept.

    ``ground_truth`` is the text after the final ``####`` with thousands separators removed
    (``"1,080"`` -> ``"1080"``). A row without ``question``/``answer`` or without ``####``
    raises ``ValueError`` naming its index and the fields it has.
    """
    return prepare_prompts(
        parse_rows(dataset, gsm8k_row),
        tokenizer,
        "question",
        max_prompt_length=max_prompt_length,
        instruction=instruction,
        system_prompt=system_prompt,
        use_chat_template=use_chat_template,
        return_dropped=return_dropped,
    )


def prepare_math500(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int | None = 512,
    instruction: str = MATH_INSTRUCTION,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
    return_dropped: bool = False,
) -> Dataset | tuple[Dataset, int]:
    """MATH-500 rows (``problem``, ``answer``) -> :func:`prepare_prompts` rows, plus ``question``
    (the ``problem`` text) and ``ground_truth`` (the ``answer`` column, for
    :func:`rltrainer.rewards.math_reward`); every column kept.
    """
    return prepare_prompts(
        parse_rows(dataset, math500_row),
        tokenizer,
        "question",
        max_prompt_length=max_prompt_length,
        instruction=instruction,
        system_prompt=system_prompt,
        use_chat_template=use_chat_template,
        return_dropped=return_dropped,
    )

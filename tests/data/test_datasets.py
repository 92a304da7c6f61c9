import json
import logging
from pathlib import Path
from typing import Any

import pytest

from rltrainer.testing import DATA_DIR, data_path

from rltrainer.data.datasets import (
    GSM8K_INSTRUCTION,
    filter_long_prompts,
    load_rows,
    prepare_gsm8k,
    prepare_math500,
    prepare_prompts,
)

SHARED = DATA_DIR  # the offline copies shipped in recipes/data
DATASETS_LOGGER = "rltrainer.data.datasets"


def _shared(*parts: str) -> Path:
    return data_path(*parts)  # raises (never skips) if the shipped data is missing


def _rows(*parts: str, n: int | None = None) -> list[dict[str, Any]]:
    lines = _shared(*parts).read_text().splitlines()
    return [json.loads(line) for line in lines[:n]]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def small_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_shared("tokenizers", "gsm8k-bpe4k"))


@pytest.fixture
def gsm8k_file(tmp_path: Path) -> Path:
    rows = _rows("gsm8k", "test.jsonl", n=5)
    rows.append({"question": "How many is a thousand and eighty?", "answer": "Count.\n#### 1,080"})
    return _write_jsonl(tmp_path / "gsm8k.jsonl", rows)


def test_load_rows_from_file_directory_and_data_files(tmp_path: Path, gsm8k_file: Path) -> None:
    assert len(load_rows(str(gsm8k_file))) == 6
    (tmp_path / "test.jsonl").write_text(gsm8k_file.read_text())
    assert len(load_rows(str(tmp_path), split="test")) == 6
    assert load_rows(str(tmp_path), data_files="gsm8k.jsonl").column_names == ["question", "answer"]


def test_load_rows_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="split 'validation'.*validation.jsonl"):
        load_rows(str(tmp_path), split="validation")

    import datasets

    def offline(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="'openai/gsm8k'.*no network.*offline.*.jsonl"):
        load_rows("openai/gsm8k")


def test_prepare_gsm8k(gsm8k_file: Path, small_tokenizer: Any) -> None:
    raw = load_rows(str(gsm8k_file))
    ds = prepare_gsm8k(raw, small_tokenizer, max_prompt_length=None)
    assert set(ds.column_names) == {"prompt", "prompt_ids", "ground_truth", "question", "answer"}  # all kept
    assert len(ds) == 6
    row = ds[0]
    assert row["question"] == raw[0]["question"]
    assert row["ground_truth"] == raw[0]["answer"].rsplit("\n#### ", 1)[1]
    expected = small_tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{raw[0]['question']} {GSM8K_INSTRUCTION}"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert row["prompt"] == expected and row["prompt"].startswith("<|im_start|>user\n")
    assert row["prompt_ids"] == small_tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert ds[5]["ground_truth"] == "1080"  # thousands separator removed


def test_prepare_without_chat_template_and_with_system_prompt(gsm8k_file: Path, small_tokenizer: Any) -> None:
    raw = load_rows(str(gsm8k_file))
    plain = prepare_gsm8k(raw, small_tokenizer, use_chat_template=False, instruction="Answer:")
    assert plain[0]["prompt"] == raw[0]["question"] + " Answer:"
    chat = prepare_gsm8k(raw, small_tokenizer, system_prompt="Be brief.")
    assert chat[0]["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_over_long_prompts_are_dropped_and_counted(
    tmp_path: Path, gsm8k_file: Path, small_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [json.loads(line) for line in gsm8k_file.read_text().splitlines()]
    rows.insert(2, {"question": "Why? " * 300, "answer": "Because.\n#### 1"})
    raw = load_rows(str(_write_jsonl(tmp_path / "long.jsonl", rows)))
    full = prepare_gsm8k(raw, small_tokenizer, max_prompt_length=None)
    limit = sorted(len(ids) for ids in full["prompt_ids"])[-2]  # the longest normal prompt fits
    with caplog.at_level(logging.INFO, logger=DATASETS_LOGGER):
        ds, n_dropped = prepare_gsm8k(raw, small_tokenizer, max_prompt_length=limit, return_dropped=True)
    assert n_dropped == 1 and len(ds) == 6
    assert all(len(ids) <= limit for ids in ds["prompt_ids"])
    assert "Why?" not in "".join(ds["question"])  # dropped, not truncated
    assert f"Dropped 1 of 7 prompts longer than {limit} tokens" in caplog.text

    kept, dropped = filter_long_prompts(full, max_prompt_length=1)
    assert (len(kept), dropped) == (0, 7)
    with pytest.raises(ValueError, match=r"max_prompt_length must be an int >= 1 .* or None \(keep all\), got 0"):
        prepare_gsm8k(raw, small_tokenizer, max_prompt_length=0)


def test_malformed_rows_raise_with_index_and_fields(tmp_path: Path, small_tokenizer: Any) -> None:
    rows = _rows("gsm8k", "test.jsonl", n=3)
    missing = _write_jsonl(tmp_path / "missing.jsonl", [*rows, {"question": "q", "foo": 1}])
    with pytest.raises(ValueError, match=r"GSM8K row 3 has no field 'answer'; fields found: \['question', 'foo'\]"):
        prepare_gsm8k(load_rows(str(missing)), small_tokenizer)
    no_marker = _write_jsonl(tmp_path / "no_marker.jsonl", [rows[0], {"question": "q", "answer": "42"}])
    with pytest.raises(ValueError, match=r"GSM8K row 1 has an answer without a final '#### <number>' line"):
        prepare_gsm8k(load_rows(str(no_marker)), small_tokenizer)
    fields = r"fields found: \['question', 'answer'\]"
    with pytest.raises(ValueError, match=r"MATH-500 row 0 has no field 'problem'; " + fields):
        prepare_math500(load_rows(str(no_marker)), small_tokenizer)


def test_prepare_math500(tmp_path: Path, small_tokenizer: Any) -> None:
    rows = _rows("math500", "test.jsonl", n=4)
    ds = prepare_math500(load_rows(str(_write_jsonl(tmp_path / "test.jsonl", rows))), small_tokenizer)
    assert ds["ground_truth"] == [row["answer"] for row in rows]
    assert ds["question"] == [row["problem"] for row in rows]
    assert ds[0]["prompt"].rstrip().endswith("\\boxed{}.<|im_end|>\n<|im_start|>assistant")


def test_whole_gsm8k_test_split_with_qwen_tokenizer() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_shared("tokenizers", "qwen2.5-instruct"))
    ds, n_dropped = prepare_gsm8k(
        load_rows(str(_shared("gsm8k", "test.jsonl"))), tokenizer, max_prompt_length=512, return_dropped=True
    )
    assert (len(ds), n_dropped) == (1319, 0)
    truths = ds["ground_truth"]
    assert all(int(t) == float(t) for t in truths)  # every gold answer is an integer
    assert sum(int(t) < 0 for t in truths) == 2
    assert ds[0]["prompt_ids"][:3] == [151644, 8948, 198]  # <|im_start|>system\n (Qwen default system prompt)


def test_prepare_prompts_keeps_every_column_from_a_prompt_column(tmp_path: Path, small_tokenizer: Any) -> None:
    rows = [{"problem": "What is 2 + 3?", "answer": "5", "source": "mine", "meta": {"level": 1}},
            {"problem": "What is 4 + 4?", "answer": "8", "source": "mine", "meta": {"level": 2}}]
    ds = prepare_prompts(load_rows(str(_write_jsonl(tmp_path / "mine.jsonl", rows))), small_tokenizer,
                         prompt_column="problem", max_prompt_length=None)
    assert set(ds.column_names) == {"problem", "answer", "source", "meta", "prompt", "prompt_ids"}
    assert ds[1]["answer"] == "8" and ds[1]["meta"] == {"level": 2} and ds[1]["problem"] == "What is 4 + 4?"
    expected = small_tokenizer.apply_chat_template([{"role": "user", "content": "What is 4 + 4?"}],
                                                   tokenize=False, add_generation_prompt=True)
    assert ds[1]["prompt"] == expected
    assert ds[1]["prompt_ids"] == small_tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_prepare_prompts_from_chat_messages(tmp_path: Path, small_tokenizer: Any) -> None:
    conversation = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 3?"}]
    rows = [{"messages": conversation, "answer": "5"}, {"messages": conversation[1:], "answer": "5"}]
    ds = prepare_prompts(load_rows(str(_write_jsonl(tmp_path / "chat.jsonl", rows))), small_tokenizer,
                         prompt_column="messages", system_prompt="Default system.")
    assert ds[0]["prompt"] == small_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                                  add_generation_prompt=True)
    assert ds[1]["prompt"].startswith("<|im_start|>system\nDefault system.<|im_end|>")  # added: it had none
    assert ds[0]["messages"] == conversation and ds["answer"] == ["5", "5"]


def test_prepare_prompts_rows_reach_the_reward_functions(tmp_path: Path, small_tokenizer: Any) -> None:
    from rltrainer.data import prompt_dataloader
    from rltrainer.modules.grpo import ROLLOUT_FIELDS

    rows = [{"problem": f"{i} + 1?", "answer": str(i + 1), "difficulty": i} for i in range(4)]
    ds = prepare_prompts(load_rows(str(_write_jsonl(tmp_path / "r.jsonl", rows))), small_tokenizer,
                         prompt_column="problem")
    batch = next(iter(prompt_dataloader(ds, batch_size=4, shuffle=False)))
    fields = {k for k in batch.keys() if k not in ROLLOUT_FIELDS}
    assert fields == {"problem", "answer", "difficulty", "prompt"}
    assert list(batch["difficulty"]) == [0, 1, 2, 3]


def test_prepare_prompts_bad_input(tmp_path: Path, small_tokenizer: Any) -> None:
    raw = load_rows(str(_write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "n": 1}])))
    with pytest.raises(ValueError, match=r"prompt_column='prompt'.*no such column.*\['question', 'n'\]"):
        prepare_prompts(raw, small_tokenizer)
    with pytest.raises(ValueError, match=r"Row 0: column 'n' must hold a string or a non-empty list.*int 1"):
        prepare_prompts(raw, small_tokenizer, prompt_column="n")
    chat = load_rows(str(_write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"text": "hi"}]}])))
    with pytest.raises(ValueError, match=r"Row 0: every chat message needs 'role' and 'content'"):
        prepare_prompts(chat, small_tokenizer, prompt_column="messages")
def test_broken_json_line_names_file_and_line(tmp_path: Path, gsm8k_file: Path) -> None:
    lines = gsm8k_file.read_text().splitlines()
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines[:3] + ['{"question": "How many?", "answer": '] + lines[3:]) + "\n")
    with pytest.raises(ValueError, match=r"broken.jsonl', line 4: not valid JSON .*fix or delete that line"):
        load_rows(str(broken))
    listed = tmp_path / "listed.jsonl"
    listed.write_text(lines[0] + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"listed.jsonl', line 2: a JSON list, not an object"):
        load_rows(str(listed))

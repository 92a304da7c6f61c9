"""rltrainer.toy: the character tokenizer, held-out problems, the supervised warm-up and greedy accuracy."""

from __future__ import annotations

import pickle
import random
from types import SimpleNamespace

import pytest
import torch

from rltrainer import toy


def test_char_tokenizer_round_trips_and_pickles():
    tokenizer = pickle.loads(pickle.dumps(toy.char_tokenizer("0123456789>")))
    ids = tokenizer("3141>", add_special_tokens=False).input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == list("3141>")
    assert tokenizer.decode(ids) == "3141>"
    assert tokenizer.decode([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id, tokenizer.pad_token_id],
                            skip_special_tokens=True) == "3141>"
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id] == [0, 1, 2, 3]
    assert len(tokenizer) == 4 + 11 and tokenizer.chat_template is None
    assert tokenizer("x", add_special_tokens=False).input_ids == [tokenizer.unk_token_id]
    assert toy.encode_prompt(tokenizer, "12") == [1, *tokenizer("12", add_special_tokens=False).input_ids]
    assert tokenizer("12").input_ids == toy.encode_prompt(tokenizer, "12")  # tokenizer(text) starts with bos
    assert toy.char_tokenizer("12", bos=None)("12").input_ids == [3, 4]  # pad, eos, unk, then the alphabet


def test_plain_prompts_from_a_file_start_with_the_tokenizers_bos_as_in_the_warm_up():
    """A toy task through ``prepare_prompts`` (the CLI's ``format: prompts``) gets the same prompt ids
    the warm-up trained on: the start token first (issue 31: without it every response was empty)."""
    from datasets import Dataset

    from rltrainer.data import prepare_prompts

    tokenizer = toy.char_tokenizer("0123456789>")
    rows = prepare_prompts(Dataset.from_list([{"q": "12>", "a": "21"}, {"q": "305>", "a": "503"}]), tokenizer,
                           prompt_column="q", use_chat_template=False, max_prompt_length=None)
    assert [row["prompt_ids"] for row in rows] == [toy.encode_prompt(tokenizer, "12>"), toy.encode_prompt(tokenizer, "305>")]
    assert rows[0]["prompt_ids"][0] == tokenizer.bos_token_id and rows[1]["a"] == "503"


def test_char_tokenizer_without_bos_with_chat_markers_and_template():
    template = "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"
    tokenizer = toy.char_tokenizer("ab", bos=None, eos="<|end|>", unk=None,
                                   special_tokens=["<|user|>", "<|assistant|>"], chat_template=template)
    assert tokenizer.bos_token_id is None and tokenizer.convert_ids_to_tokens([0, 1, 2, 3, 4, 5]) == [
        "<pad>", "<|end|>", "<|user|>", "<|assistant|>", "a", "b"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|user|>", "a", "b", "<|end|>", "<|assistant|>"]
    assert toy.encode_prompt(tokenizer, "ab") == [4, 5]
    assert tokenizer("c", add_special_tokens=False).input_ids == [0]  # unk=None: pad


def test_char_tokenizer_refuses_clashes():
    with pytest.raises(ValueError, match="single characters.*special_tokens"):
        toy.char_tokenizer(["ab", "c"])
    with pytest.raises(ValueError, match="distinct"):
        toy.char_tokenizer("ab", eos="<pad>")


def test_held_out_problems_are_never_sampled_and_a_small_space_raises():
    problems = toy.Problems(lambda rng: rng.randrange(100), lambda n: (f"{n}>", str(n)), num_val=30, seed=0)
    assert len(problems.val) == 30 and not problems.val & set(problems.sample(60))
    assert problems.held_out() == [(f"{n}>", str(n)) for n in sorted(problems.val)]
    tokenizer = toy.char_tokenizer("0123456789>")
    (row,) = problems.rows([7], tokenizer)
    assert row == {"prompt_ids": toy.encode_prompt(tokenizer, "7>"), "answer": "7"}
    with pytest.raises(ValueError, match=r"sample\(71\): only 70 distinct.*\(30 are held out\)"):
        problems.sample(71)


def test_exact_match():
    assert toy.exact_match(["12", " 12 ", "1", "123"], answer=["12"] * 4) == [1.0, 1.0, 0.0, 0.0]


def copy_task(rng: random.Random) -> tuple[str, str]:
    digit = str(rng.randrange(10))
    return f"{digit}>", digit + digit


def test_warm_up_learns_a_trivial_task_and_accuracy_agrees():
    """Copying a digit twice: the warm-up reaches its target and greedy decoding is then right."""
    torch.manual_seed(0)
    tokenizer = toy.char_tokenizer("0123456789>")
    model = toy.tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1)
    rng = random.Random(0)
    result = toy.warm_up(model, tokenizer, lambda n: [copy_task(rng) for _ in range(n)], steps=1000, batch_size=32,
                         target_exact=1.0, window=5)
    assert result.reached and result.exact == 1.0 and result.position_accuracy == [1.0, 1.0], result
    assert result.steps < 1000 and not result.model.training
    problems = [(f"{d}>", f"{d}{d}") for d in range(10)]
    assert toy.accuracy(result.model, tokenizer, problems) >= 0.9


def test_warm_up_pads_mixed_lengths_and_learns_only_marked_pieces(tmp_path):
    tokenizer = toy.char_tokenizer("0123456789>|", bos=None)
    examples = [("12>", "3"), ("1>", [("45", True), ("|", False), ("6", True)])]
    ids, targets, P, mask = toy._teacher_forcing_batch(examples, tokenizer)
    tok = tokenizer.convert_tokens_to_ids
    assert P == 3 and ids.shape == (2, 3 + 5) and mask is not None
    assert ids[1, 0] == tokenizer.pad_token_id and mask[1].tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    assert targets.tolist() == [[tok("3"), tokenizer.eos_token_id, -100, -100, -100],
                                [tok("4"), tok("5"), -100, tok("6"), tokenizer.eos_token_id]]
    model = toy.tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1)
    first = toy.warm_up(model, tokenizer, lambda n: examples, steps=1, lr=1e-2).loss
    result = toy.warm_up(model, tokenizer, lambda n: examples, steps=30, lr=1e-2, save_to=tmp_path / "warm")
    assert result.loss < first / 2 and not result.reached  # no target: all steps run
    assert (tmp_path / "warm" / "config.json").is_file() and (tmp_path / "warm" / "tokenizer.json").is_file()


def test_warm_up_counts_only_the_problems_it_is_told_to(caplog):
    tokenizer = toy.char_tokenizer("0123456789>")
    model = toy.tiny_model(tokenizer, seed=0, hidden_size=16, num_layers=1)
    with caplog.at_level("WARNING", logger="rltrainer.toy"):
        result = toy.warm_up(model, tokenizer, lambda n: [("1>", "1")] * n, steps=2, lr=0.0, target_exact=1.0,
                             counted=lambda prompt, answer: False)
    assert result.steps == 2 and not result.reached and "was not reached in 2 steps" in caplog.text
    with pytest.raises(ValueError, match="positive ints; got steps=0, window=0"):
        toy.warm_up(model, tokenizer, lambda n: [], steps=0, window=0)


def test_accuracy_counts_exact_matches_over_batches():
    tokenizer = toy.char_tokenizer("0123456789>")
    seen = []

    class Engine:
        def generate(self, prompts, sampling):
            seen.append((len(prompts), sampling.temperature, sampling.max_new_tokens))
            return SimpleNamespace(text=["12", "9", " 34", "5"][len(seen) * 2 - 2 : len(seen) * 2])

        def wake_up(self):
            pass

    trainer = SimpleNamespace(sync=SimpleNamespace(push=lambda version, mode=None: {}), global_step=0,
                              engine=Engine())
    problems = [("1>", "12"), ("2>", "8"), ("3>", "34"), ("4>", "55")]
    assert toy.accuracy(trainer, tokenizer, problems, batch_size=2) == 0.5
    assert seen == [(2, 0.0, 3), (2, 0.0, 3)]  # greedy; the longest answer and eos
    with pytest.raises(ValueError, match="after fit"):
        toy.accuracy(SimpleNamespace(sync=None, engine=None, global_step=0), tokenizer, problems)
    with pytest.raises(ValueError, match="at least one"):
        toy.accuracy(trainer, tokenizer, [])

"""Checkpoints on disk: visible only when complete (a SIGKILL mid-save leaves ``last`` on the previous
one), read with ``weights_only=True``, checked against their checksums before anything is loaded,
one clear error per kind of bad checkpoint, ``fit(ckpt_path="last")`` on a fresh run and with a
dangling ``last``, and retention over a resume and a deletion killed half-way."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rltrainer import GRPO, Callback, ModelCheckpoint, Trainer, prompt_dataloader
from rltrainer.checkpoints import (MANIFEST, CheckpointError, atomic_directory, find_last, point_last,
                                   remove_checkpoint, write_manifest)
from rltrainer.testing import scribble, tiny_qwen2_config


def zero_reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def make_module(config, tokenizer):
    return GRPO(config, tokenizer, reward_funcs=zero_reward, num_generations=2, max_new_tokens=4, lr=1e-3)


class Steps(Callback):
    """Records the step counter after each step."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, trainer, module, metrics) -> None:
        self.steps.append(trainer.global_step)


def fit(config, tokenizer, prompts, root, max_steps, ckpt_path=None, callbacks=()):
    steps = Steps()
    trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, default_root_dir=root,
                      callbacks=[*callbacks, steps])
    trainer.fit(make_module(config, tokenizer), prompt_dataloader(prompts, batch_size=2, shuffle=False),
                ckpt_path=ckpt_path)
    return trainer, steps.steps


# -- crash safety --------------------------------------------------------------------------------------
def test_atomic_directory_shows_nothing_until_complete(tmp_path):
    target = tmp_path / "step=1.ckpt"
    with pytest.raises(RuntimeError, match="boom"), atomic_directory(target) as tmp:
        (tmp / "part").write_text("half")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    for text in ("first", "second"):  # a second save of the same name replaces the first
        with atomic_directory(target) as tmp:
            (tmp / "part").write_text(text)
            assert not target.exists() or (target / "part").read_text() == "first"
    assert (target / "part").read_text() == "second" and [p.name for p in tmp_path.iterdir()] == ["step=1.ckpt"]
    point_last(tmp_path, target)
    point_last(tmp_path, target)  # replaced in one rename, no error for an existing link
    assert os.readlink(tmp_path / "last.ckpt") == "step=1.ckpt"


KILL_MID_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    from rltrainer import GRPO, Callback, ModelCheckpoint, Trainer, prompt_dataloader
    from rltrainer.data import load_rows, prepare_gsm8k
    from rltrainer.testing import data_path, load_tokenizer, tiny_qwen2_config

    class KillMidSave(Callback):  # the models are written (under the temporary name), trainer.pt not yet
        def on_save_checkpoint(self, trainer, module, checkpoint):
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    def zero_reward(completions, **kwargs):
        return [float(len(c) % 2) for c in completions]

    tok = load_tokenizer("gsm8k-bpe4k")
    rows = prepare_gsm8k(load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(8)), tok, max_prompt_length=160)
    module = GRPO(tiny_qwen2_config(len(tok), hidden_size=32, num_layers=2), tok, reward_funcs=zero_reward,
                  num_generations=2, max_new_tokens=4, lr=1e-3)
    Trainer(max_steps=3, logger=False, enable_progress_bar=False, default_root_dir=sys.argv[1],
            callbacks=[ModelCheckpoint(every_n_steps=1), KillMidSave()]).fit(
        module, prompt_dataloader(rows, batch_size=2, shuffle=False))
""")


def test_sigkill_mid_save_resumes_from_the_previous_checkpoint(tmp_path, tiny_config, bpe_tokenizer, gsm8k_prompts):
    script = tmp_path / "train.py"
    script.write_text(KILL_MID_SAVE)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == -9, done.stderr[-2000:]
    checkpoints = tmp_path / "checkpoints"
    assert os.readlink(checkpoints / "last.ckpt") == "step=1.ckpt"
    assert not (checkpoints / "step=2.ckpt").exists()
    (partial,) = checkpoints.glob(".step=2.ckpt.tmp-*")  # what the killed save had written
    assert (partial / "training").is_dir() and not (partial / "trainer.pt").exists()

    trainer, steps = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=3, ckpt_path="last",
                         callbacks=[ModelCheckpoint(every_n_steps=1)])
    assert steps == [2, 3] and trainer.global_step == 3  # resumed after step 1
    assert not list(checkpoints.glob(".*tmp-*"))  # the next save of step=2 removed the partial one
    assert os.readlink(checkpoints / "last.ckpt") == "step=3.ckpt"


# -- clear errors ---------------------------------------------------------------------------------------
class Opaque:
    """A class weights_only loading does not know."""


@pytest.fixture
def saved(tmp_path, tiny_config, bpe_tokenizer, gsm8k_prompts) -> Path:
    trainer, _ = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=1)
    trainer.save_checkpoint(tmp_path / "good.ckpt")
    return tmp_path / "good.ckpt"


def corrupt(saved: Path, name: str, how) -> Path:
    bad = saved.parent / name
    shutil.copytree(saved, bad)
    how(bad)
    return bad


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def rehash(checkpoint: Path) -> None:
    """Rewrite ``checksums.json`` for the files as they are now (a checkpoint whose files were
    replaced on purpose: the errors after the checksums' are tested)."""
    write_manifest(checkpoint, {})


def unverified(checkpoint: Path) -> None:
    """Make ``checkpoint`` look saved by an older rltrainer: no ``checksums.json``, and no mention of it."""
    (checkpoint / MANIFEST).unlink()
    state = torch.load(checkpoint / "trainer.pt", weights_only=False)
    del state["checksums"]
    torch.save(state, checkpoint / "trainer.pt")


def zero_header(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(bytes(64) + data[64:])


def test_bad_checkpoints_raise_one_clear_error(saved, tiny_config, bpe_tokenizer, gsm8k_prompts):
    def resume(path, config=tiny_config):
        fit(config, bpe_tokenizer, gsm8k_prompts, saved.parent, max_steps=2, ckpt_path=path)

    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        resume(saved.parent / "nope.ckpt")
    file = saved.parent / "single.ckpt"
    torch.save({"state_dict": {}}, file)
    with pytest.raises(CheckpointError, match=r"single\.ckpt is a file; an rltrainer checkpoint is a directory"):
        resume(file)
    for part in ("trainer.pt", "training/state.pt"):  # the checksum catches it before torch.load
        cut = corrupt(saved, f"cut-{part.replace('/', '-')}.ckpt", lambda p: truncate(p / part))
        with pytest.raises(CheckpointError, match=rf"{cut}/{part} is corrupted: its sha256 is [0-9a-f]{{64}}, but"):
            resume(cut)
    cut = corrupt(saved, "cut.ckpt", lambda p: (unverified(p), truncate(p / "trainer.pt")))
    with pytest.raises(CheckpointError, match=rf"{cut}/trainer.pt should hold .* cannot be read: it is truncated"):
        resume(cut)
    cut_models = corrupt(saved, "cut_models.ckpt", lambda p: (unverified(p), truncate(p / "training" / "state.pt")))
    with pytest.raises(CheckpointError, match=rf"{cut_models}/training/state.pt should hold the models"):
        resume(cut_models)
    foreign = corrupt(saved, "foreign.ckpt", lambda p: (torch.save({"weights": torch.ones(1)}, p / "trainer.pt"),
                                                        rehash(p)))
    with pytest.raises(CheckpointError, match=r"is not an rltrainer checkpoint: expected a dict with format="):
        resume(foreign)
    unsafe = corrupt(saved, "unsafe.ckpt", lambda p: (torch.save(
        {**torch.load(p / "trainer.pt", weights_only=False), "callback": Opaque()}, p / "trainer.pt"), rehash(p)))
    with pytest.raises(CheckpointError, match=r"weights_only=True refuses.*add_safe_globals"):
        resume(unsafe)


# -- checksums ----------------------------------------------------------------------------------------------
def test_every_file_is_checksummed_and_checked_before_loading(saved, tiny_config, bpe_tokenizer, gsm8k_prompts):
    """4 KiB of random bytes in the middle of any file, or its first 64 bytes zeroed, raise a
    CheckpointError naming the file, with the recorded and the found sha256 (before, random bytes in
    the optimizer state loaded Adam moments of 3e38 and NaN without an error)."""
    listed = json.loads((saved / MANIFEST).read_text())
    assert listed["algorithm"] == "sha256" and sorted(listed["files"]) == ["trainer.pt", "training/state.pt"]
    for part in listed["files"]:
        for name, how in (("scribbled", scribble), ("zeroed", zero_header)):
            bad = corrupt(saved, f"{name}-{part.replace('/', '-')}.ckpt", lambda p: how(p / part))
            with pytest.raises(CheckpointError) as info:
                fit(tiny_config, bpe_tokenizer, gsm8k_prompts, saved.parent, max_steps=2, ckpt_path=bad)
            message = str(info.value)
            assert message.startswith(f"{bad / part} is corrupted: its sha256 is "), message
            assert listed["files"][part] in message and "add_safe_globals" not in message
    missing = corrupt(saved, "missing.ckpt", lambda p: (p / "training" / "state.pt").unlink())
    with pytest.raises(CheckpointError, match=rf"{missing}/training/state.pt is missing \(checksums.json lists it\)"):
        fit(tiny_config, bpe_tokenizer, gsm8k_prompts, saved.parent, max_steps=2, ckpt_path=missing)
    no_manifest = corrupt(saved, "no_manifest.ckpt", lambda p: (p / MANIFEST).unlink())
    with pytest.raises(CheckpointError, match=r"has no checksums.json, but was saved with one"):
        fit(tiny_config, bpe_tokenizer, gsm8k_prompts, saved.parent, max_steps=2, ckpt_path=no_manifest)
    damaged = corrupt(saved, "damaged.ckpt", lambda p: (p / MANIFEST).write_text("{not json"))
    with pytest.raises(CheckpointError, match=rf"{damaged}/checksums.json should list the sha256 .* it is damaged"):
        fit(tiny_config, bpe_tokenizer, gsm8k_prompts, saved.parent, max_steps=2, ckpt_path=damaged)


def test_a_checkpoint_without_checksums_loads_with_a_warning(saved, tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                             caplog):
    old = corrupt(saved, "old.ckpt", unverified)
    with caplog.at_level(logging.WARNING, logger="rltrainer.checkpoints"):
        trainer, steps = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, saved.parent, max_steps=2, ckpt_path=old)
    assert steps == [2] and f"{old} has no checksums.json" in caplog.text
    zeroed = corrupt(saved, "old_zeroed.ckpt", lambda p: (unverified(p), zero_header(p / "training" / "state.pt")))
    with pytest.raises(CheckpointError, match=r"state.pt should hold .* cannot be read: .*damaged") as info:
        fit(tiny_config, bpe_tokenizer, gsm8k_prompts, saved.parent, max_steps=2, ckpt_path=zeroed)
    assert "add_safe_globals" not in str(info.value)  # a damaged pickle is not an unknown class


def test_a_checkpoint_of_another_model_size_names_the_differences(saved, bpe_tokenizer, gsm8k_prompts):
    wider = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=48, num_layers=2)
    with pytest.raises(CheckpointError) as info:
        fit(wider, bpe_tokenizer, gsm8k_prompts, saved.parent, max_steps=2, ckpt_path=saved)
    message = str(info.value)
    assert str(saved) in message and "tensor(s) differ in name or shape" in message
    assert "model.embed_tokens.weight: model (4" in message and ", 48), checkpoint (" in message
    assert message.count("; ") == 4  # the first five differences, and the count of all


# -- fit(ckpt_path="last") --------------------------------------------------------------------------------
def test_last_on_a_fresh_run_warns_and_starts_then_resumes_from_dirpath(tmp_path, tiny_config, bpe_tokenizer,
                                                                        gsm8k_prompts, caplog):
    mine = tmp_path / "mine"
    with caplog.at_level(logging.WARNING, logger="rltrainer.trainer"):
        trainer, steps = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=1, ckpt_path="last",
                             callbacks=[ModelCheckpoint(dirpath=mine, every_n_steps=1)])
    assert steps == [1] and "no checkpoint in" in caplog.text and str(mine) in caplog.text
    assert (mine / "last.ckpt" / "trainer.pt").is_file() and not (tmp_path / "checkpoints").exists()
    trainer, steps = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=2, ckpt_path="last",
                         callbacks=[ModelCheckpoint(dirpath=mine, every_n_steps=1)])
    assert steps == [2]



def test_a_dangling_last_is_an_error_unless_starting_fresh(tmp_path, tiny_config, bpe_tokenizer, gsm8k_prompts):
    checkpoints = tmp_path / "checkpoints"
    fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=2, callbacks=[ModelCheckpoint(every_n_steps=1)])
    assert os.readlink(checkpoints / "last.ckpt") == "step=2.ckpt" and find_last(checkpoints).name == "last.ckpt"
    shutil.rmtree(checkpoints / "step=2.ckpt")  # what last points to is gone; step=1 was pruned (keep=1)
    with pytest.raises(CheckpointError, match=r"last.ckpt points to step=2.ckpt, which does not exist .*No "
                                              r"checkpoint is left there: or start fresh with ckpt_path=None"):
        fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=3, ckpt_path="last",
            callbacks=[ModelCheckpoint(every_n_steps=1)])
    with pytest.raises(CheckpointError, match=r"last.ckpt points to step=2.ckpt, which does not exist"):
        fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=3, ckpt_path=checkpoints / "last.ckpt")
    _, steps = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=1, ckpt_path=None,
                   callbacks=[ModelCheckpoint(every_n_steps=1, save_last=False, keep=2)])
    assert steps == [1]  # a fresh start, asked for
    (checkpoints / "last.ckpt").unlink()
    (checkpoints / "last.ckpt").symlink_to("step=9.ckpt")  # and step=1.ckpt (the fresh run's) is there
    with pytest.raises(CheckpointError, match=rf"e.g. the newest left there: ckpt_path='{checkpoints}/step=1.ckpt'"):
        fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=3, ckpt_path="last")


def test_keep_prunes_the_checkpoints_written_before_a_resume(tmp_path, tiny_config, bpe_tokenizer, gsm8k_prompts):
    checkpoints = tmp_path / "checkpoints"

    def names(directory):
        return sorted(p.name for p in directory.iterdir())

    fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=2,
        callbacks=[ModelCheckpoint(every_n_steps=1, keep=2)])
    assert names(checkpoints) == ["last.ckpt", "step=1.ckpt", "step=2.ckpt"]
    _, steps = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=4, ckpt_path="last",
                   callbacks=[ModelCheckpoint(every_n_steps=1, keep=2)])
    assert steps == [3, 4] and names(checkpoints) == ["last.ckpt", "step=3.ckpt", "step=4.ckpt"]  # was 1, 2, 3, 4
    _, steps = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=2,  # another run, beside
                   callbacks=[ModelCheckpoint(every_n_steps=1, keep=1)])
    assert names(tmp_path / "checkpoints-2") == ["last.ckpt", "step=2.ckpt"]
    assert names(checkpoints) == ["last.ckpt", "step=3.ckpt", "step=4.ckpt"]  # never another run's


def test_a_deletion_killed_half_way_is_finished_and_never_resumed(tmp_path, tiny_config, bpe_tokenizer,
                                                                   gsm8k_prompts, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=3,
        callbacks=[ModelCheckpoint(every_n_steps=1, keep=3, save_last=False)])

    def killed(path, *args, **kwargs):  # the process dies after removing one file
        (Path(path) / "trainer.pt").unlink()
        raise SystemExit("killed mid-delete")

    with monkeypatch.context() as patch:
        patch.setattr("rltrainer.checkpoints.shutil.rmtree", killed)
        with pytest.raises(SystemExit):
            remove_checkpoint(checkpoints / "step=1.ckpt")
    (half,) = checkpoints.glob(".step=1.ckpt.deleting-*")  # renamed first: no step=1.ckpt is left half-deleted
    assert not (checkpoints / "step=1.ckpt").exists() and (half / "training" / "state.pt").is_file()
    (checkpoints / "step=3.ckpt" / "training" / "state.pt").unlink()  # one an older rltrainer left half-deleted
    assert find_last(checkpoints) == checkpoints / "step=2.ckpt"  # never the half-deleted step 3
    _, steps = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=4, ckpt_path="last",
                   callbacks=[ModelCheckpoint(every_n_steps=1, keep=2, save_last=False)])
    assert steps == [3, 4]  # resumed from step 2
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step=3.ckpt", "step=4.ckpt"]  # nothing else left

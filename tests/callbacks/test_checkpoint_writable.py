"""A ``ModelCheckpoint`` whose directory cannot be written is refused when ``fit`` starts, before the
first step, not at its first save (``every_n_steps`` in)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltrainer import GRPO, Callback, ModelCheckpoint, Trainer, prompt_dataloader
from rltrainer.files import check_writable
from rltrainer.testing import length_reward
from rltrainer.testing.tmpfs import _unshare, tmpfs_unavailable


class Steps(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, trainer, module, metrics):
        self.steps += 1


def test_an_unwritable_checkpoint_directory_is_refused_before_the_first_step(tmp_path, tiny_config, bpe_tokenizer,
                                                                              gsm8k_prompts):
    (tmp_path / "a_file").write_text("not a directory")
    dirpath = tmp_path / "a_file" / "checkpoints"  # cannot be created, even by root
    steps = Steps()
    trainer = Trainer(max_steps=3, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                      callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_steps=2), steps])
    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4)
    with pytest.raises(NotADirectoryError, match=rf"ModelCheckpoint\(dirpath='{dirpath}'\) cannot write to {dirpath}: "
                                                 r"Not a directory .*Nothing was trained yet"):
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2, shuffle=False))
    assert steps.steps == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a directory without write permission")
def test_a_directory_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(PermissionError, match=f"ModelCheckpoint cannot write to {locked}: Permission denied"):
        check_writable(locked, "ModelCheckpoint")


@pytest.mark.skipif(tmpfs_unavailable() is not None, reason=str(tmpfs_unavailable()))
def test_a_read_only_file_system_is_refused(tmp_path):
    """The issue's case: a read-only mount (here a private read-only tmpfs), which root cannot write either."""
    mount = tmp_path / "ro"
    mount.mkdir()
    probe = (f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r}); from rltrainer.files import "
             f"check_writable\ntry:\n    check_writable({str(mount / 'ckpt')!r}, 'ModelCheckpoint')\n"
             "except OSError as e:\n    print(e.errno, e)")
    argv = _unshare(mount, 1 << 20, f"{sys.executable} -c {_quote(probe)}")
    argv[-1] = argv[-1].replace("mount -t tmpfs -o size=", "mount -t tmpfs -o ro,size=", 1)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith(f"{errno.EROFS} [Errno {errno.EROFS}] ModelCheckpoint cannot write to "
                                 f"{mount / 'ckpt'}: Read-only file system"), (out.stdout, out.stderr)


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)

"""A full disk on 2 FSDP2 ranks (Ray, gloo): every rank's DCP save fails on a private tmpfs, and the
controller raises one DiskFullError naming the rank, the file and the bytes, with the previous
checkpoint and the metrics intact (the single-process case: tests/test_faults_durable.py)."""

from __future__ import annotations

import os

import pytest

from rltrainer.checkpoints import read_trainer_state
from rltrainer.files import read_rows
from rltrainer.testing.disk_full import run_disk_full
from rltrainer.testing.tmpfs import tmpfs_unavailable


@pytest.mark.slow
@pytest.mark.skipif(tmpfs_unavailable() is not None, reason=str(tmpfs_unavailable()))
def test_a_full_disk_on_two_ranks_is_one_clear_error_and_loses_nothing_written(tmp_path):
    report, kept, done = run_disk_full(tmp_path, 64 << 10, strategy="fsdp2", devices=2)
    assert done.returncode == 0 and report, done.stderr[-3000:]
    assert report["type"] == "DiskFullError" and report["errno"] == 28 and report["step"] == 2, report
    message = report["message"]
    assert message.startswith("Rank ") and "The disk is full (No space left on device) writing " in message
    assert "/checkpoints/.step=2.ckpt.tmp-" in message and "/training (this rank's shards" in message
    assert "needed about 1," in message and "bytes were free" in message  # half of ~2.5 MB per rank
    # the figures that explain it: both ranks write into one file system at once
    assert "and the 2 ranks' shards together about 2,4" in message
    assert "bytes written into the same file system" in message
    assert "65,536 bytes were free when it started, of the 25,165,824 of the file system mounted at " in message
    assert "WorkerError" in report["traceback"] and "unexpected pos" not in message
    assert report["seconds"] < 30
    assert os.readlink(kept / "checkpoints" / "last.ckpt") == "step=1.ckpt"
    assert read_trainer_state(kept / "checkpoints" / "step=1.ckpt")["global_step"] == 1
    assert not list((kept / "checkpoints").glob(".*tmp-*"))
    rows = read_rows(kept / "lightning_logs" / "version_0" / "metrics.csv")[1]
    assert [int(r["step"]) for r in rows if r.get("critic/score/mean")] == [1, 2]
    assert not [name for name in report["left_running"] if "Worker" in name], report["left_running"]  # ranks gone

"""``rltrainer.testing.data_path`` from a clone, from ``RLTRAINER_DATA``, and after a plain
``pip install .`` (no ``recipes/data`` next to the package): issue 18, item 12."""

from __future__ import annotations

import pytest

from rltrainer import testing


def test_finds_the_clones_data():
    assert testing.data_path("gsm8k", "train.jsonl").is_file()
    assert testing.DATA_DIR == testing.CLONE_DATA_DIR


def test_rltrainer_data_overrides(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    monkeypatch.setenv("RLTRAINER_DATA", str(tmp_path))
    assert testing.data_path("gsm8k") == tmp_path / "gsm8k"
    with pytest.raises(FileNotFoundError, match=r"holds: gsm8k;.*layout of recipes/data"):
        testing.data_path("math500", "test.jsonl")
    monkeypatch.setenv("RLTRAINER_DATA", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"RLTRAINER_DATA, which is not a folder"):
        testing.data_path("gsm8k")


def test_an_installed_package_without_the_data_says_how_to_get_it(tmp_path, monkeypatch):
    """As after ``pip install .``: no recipes/data beside the package, none in the working directory."""
    monkeypatch.delenv("RLTRAINER_DATA", raising=False)
    monkeypatch.setattr(testing, "CLONE_DATA_DIR", tmp_path / "site-packages" / "recipes" / "data")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as error:
        testing.data_path("tokenizers", "qwen3")
    message = str(error.value)
    for part in ("tokenizers/qwen3", "pip install .", "clone", "pip install -e .", "RLTRAINER_DATA=", str(tmp_path)):
        assert part in message, message


def test_an_installed_package_finds_the_data_of_the_working_directory(tmp_path, monkeypatch):
    """A plain install run from a clone's root (``python recipes/...``) still finds ``recipes/data``."""
    monkeypatch.delenv("RLTRAINER_DATA", raising=False)
    monkeypatch.setattr(testing, "CLONE_DATA_DIR", tmp_path / "nowhere")
    (tmp_path / "recipes" / "data" / "gsm8k").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert testing.data_path("gsm8k") == tmp_path / "recipes" / "data" / "gsm8k"

"""Fixtures of the text tests: the tiny tokenizer on disk and loaded."""

from pathlib import Path

import pytest

from app.text.tiny import write_tiny_tokenizer
from app.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the tiny tokenizer."""
    out_dir = tmp_path_factory.mktemp("tiny")
    write_tiny_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    """The tiny tokenizer, loaded."""
    return Tokenizer.from_dir(tiny_dir)

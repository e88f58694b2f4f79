"""Reading the JSON files of a model directory, with one-line errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.errors import StrataError


def read_json_object(path: Path) -> dict[str, Any]:
    """Parse a file holding one JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise StrataError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StrataError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise StrataError(f"{path} does not hold a JSON object")
    return data


def directory_eos_ids(directory: Path, config_ids: tuple[int, ...]) -> tuple[int, ...]:
    """A model directory's end-of-sequence ids: generation_config.json's, then `config_ids` (config.json's),
    without repeats."""
    ids: list[int] = []
    path = directory / "generation_config.json"
    if path.is_file():
        value = read_json_object(path).get("eos_token_id")
        ids = [] if value is None else [value] if isinstance(value, int) else list(value)
    return tuple(ids + [i for i in config_ids if i not in ids])

"""A benchmark's result line: printed as JSON, and appended to a JSON-lines file where one is named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(line: dict[str, Any], out: str | Path | None) -> None:
    """Print `line` as one JSON line (flushed) and append it to `out`, if given."""
    text = json.dumps(line)
    print(text, flush=True)
    if out:
        with open(out, "a") as file:
            file.write(text + "\n")

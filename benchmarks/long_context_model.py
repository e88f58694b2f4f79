"""Write the tiny random model with a longer context, for CPU benchmarks of long conversations.

    python benchmarks/long_context_model.py DIR [--context 40960]

The tiny random Qwen3-Next checkpoint of app/random_model.py (the layout the demo model was trained from, at a
smaller size), with `max_position_embeddings` raised (its weights do not depend on it), so that
`strata bench --model DIR` can hold 32K-token conversations.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.random_model import write_random_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--context", type=int, default=40960)
    args = parser.parse_args()
    write_random_model(args.directory)
    config_path = args.directory / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = args.context
    config_path.write_text(json.dumps(config, indent=2))
    print(args.directory)


if __name__ == "__main__":
    main()

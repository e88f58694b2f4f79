"""Write the tiny random model (or a copy of the demo model) with a longer context, for CPU benchmarks of long
conversations.

    python benchmarks/long_context_model.py DIR [--context 40960] [--demo]

The tiny random Qwen3-Next checkpoint of app/random_model.py (the layout the demo model was trained from, at a
smaller size), or with `--demo` the demo model (app/strata-demo), with `max_position_embeddings` raised (its
weights do not depend on it), so that `strata bench --model DIR` can hold 32K-token conversations.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.default_model import default_model_dir
from app.random_model import write_random_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--context", type=int, default=40960)
    parser.add_argument("--demo", action="store_true", help="copy the demo model instead")
    args = parser.parse_args()
    if args.demo:
        shutil.copytree(default_model_dir(), args.directory, dirs_exist_ok=True)
    else:
        write_random_model(args.directory)
    config_path = args.directory / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = args.context
    config_path.write_text(json.dumps(config, indent=2))
    print(args.directory)


if __name__ == "__main__":
    main()

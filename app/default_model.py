"""The default model: the small trained demo model shipped in `app/strata-demo/` (docs/DEMO_MODEL.md).

It is an ordinary HF directory (config.json, bf16 safetensors, tokenizer, ChatML template) that the normal
loader opens; `tools/train_demo.py` made it. It writes plausible Python and answers chat requests with a
function; it is not an assistant.
"""

from __future__ import annotations

from pathlib import Path

from app.errors import StrataError

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "strata-demo"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_dir() -> Path:
    """The demo model's directory, after checking that its files are there (an install can lose them)."""
    missing = [name for name in FILES if not (DEMO_MODEL_DIR / name).is_file()]
    if missing:
        raise StrataError(
            f"the built-in demo model is incomplete ({', '.join(missing)} missing from {DEMO_MODEL_DIR}); "
            "reinstall Strata or pass --model DIR"
        )
    return DEMO_MODEL_DIR

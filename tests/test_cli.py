"""`strata generate`: output format, agreement with transformers, the default model, errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import hf_model, write_checkpoint
from transformers import AutoTokenizer

from app.cli import build_parser, engine_config, exposure_warning, main
from app.engine.config import PARK_DISK, PARK_MEMORY, default_park_dir


def _generate(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["generate", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_generate_json_equals_transformers_greedy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str
) -> None:
    path = write_checkpoint(tmp_path, arch)
    prompt = "def fibonacci(n):"
    ids = AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]
    with torch.no_grad():
        expected = (
            hf_model(arch)
            .generate(
                torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :]
            .tolist()
        )

    out = _generate(capsys, "--model", str(path), "--prompt", prompt, "--max-tokens", "24", "--ignore-eos")
    assert out["token_ids"] == expected
    assert out["text"] == AutoTokenizer.from_pretrained(path).decode(expected, skip_special_tokens=True)

    drafted = [*("--model", str(path), "--prompt", prompt, "--max-tokens", "24", "--ignore-eos")]
    assert _generate(capsys, *drafted, "--spec", "ngram", "--spec-tokens", "5")["token_ids"] == expected

    if arch == "qwen3_moe":  # ids given (read before the model sees them), the split (its tests take both)
        by_ids = [*("--model", str(path), "--prompt-token-ids", ",".join(map(str, ids)))]
        assert _generate(capsys, *by_ids, "--max-tokens", "24", "--ignore-eos")["token_ids"] == expected
        split = [
            *("--model", str(path), "--prompt", prompt, "--max-tokens", "24", "--ignore-eos"),
            "--layer-split",
            "2",
        ]
        assert _generate(capsys, *split)["token_ids"] == expected  # two stages over gloo


def test_seeded_sampling_repeats_and_chat_uses_the_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(write_checkpoint(tmp_path, "qwen3_next"))
    args = (
        "--model",
        path,
        "--chat",
        "--prompt",
        "Hi",
        "--temperature",
        "1.0",
        "--max-tokens",
        "12",
        "--ignore-eos",
    )
    first = _generate(capsys, *args, "--seed", "7")
    again = _generate(capsys, *args, "--seed", "7")
    other = _generate(capsys, *args, "--seed", "8")
    assert first == again
    assert first["token_ids"] != other["token_ids"]
    assert len(first["token_ids"]) == 12


def test_generation_stops_at_eos(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_checkpoint(tmp_path, "qwen3_moe")
    greedy = _generate(capsys, "--model", str(path), "--prompt", "Hello", "--max-tokens", "8", "--ignore-eos")
    eos = greedy["token_ids"][3]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    stopped = _generate(capsys, "--model", str(path), "--prompt", "Hello", "--max-tokens", "8")
    assert stopped["token_ids"] == greedy["token_ids"][: greedy["token_ids"].index(eos) + 1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chat", "--prompt-token-ids", "1,2"], "--chat takes --prompt text"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--prompt-token-ids", "1,99999"], "prompt token id 99999 is outside the vocabulary [0, 512)"),
        (["--max-tokens", "100000"], "exceeds the context of 512 tokens"),
        (["--layer-split", "4"], "--layer-split 4: the model has 3 layers, so 1 to 3 stages"),
    ],
)
def test_bad_requests_get_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    path = write_checkpoint(tmp_path, "qwen3_moe")
    capsys.readouterr()
    assert main(["generate", "--model", str(path), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("strata: error: ") and message in err and err.count("\n") == 1


def test_the_default_model_is_the_shipped_demo_and_writes_python(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "app.cli", "generate", "--json", "--prompt", "def ", "--max-tokens", "8"]
    done = subprocess.run(
        [*command, "--temperature", "0"], env=env, capture_output=True, timeout=300, check=True
    )
    text = json.loads(done.stdout)["text"]
    assert re.match(r"[A-Za-z_]\w*\(", text), text  # a function's name and its opening parenthesis
    assert not (tmp_path / "strata" / "models").exists()  # nothing written: the model ships with Strata


def test_parking_and_kv_options_reach_the_engine_config(tmp_path: Path) -> None:
    parser = build_parser()
    defaults = engine_config(parser.parse_args(["generate", "--prompt", "x"]))
    assert defaults.prefix_cache and defaults.park_memory == PARK_MEMORY and defaults.park_disk == PARK_DISK
    assert defaults.park_dir == str(default_park_dir())
    args = ["generate", "--prompt", "x", "--no-prefix-cache", "--park-memory", "512MiB", "--park-disk", "0"]
    config = engine_config(parser.parse_args([*args, "--park-dir", str(tmp_path)]))
    assert not config.prefix_cache and config.park_memory == 512 << 20 and config.park_disk == 0
    assert config.park_dir == str(tmp_path)
    assert defaults.kv_dtype == "auto"
    assert engine_config(parser.parse_args([*args, "--kv-dtype", "fp8"])).kv_dtype == "fp8"


def test_a_second_generate_continues_from_the_parked_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two commands, two engines: the second prompt extends the first and is read from its park file."""
    path = write_checkpoint(tmp_path / "model", "qwen3_next")
    options = ["--model", str(path), "--dtype", "float32", "--max-tokens", "6", "--temperature", "0"]
    options += ["--park-dir", str(tmp_path / "parked")]
    first = _generate(capsys, *options, "--prompt-token-ids", ",".join(str(3 + i % 400) for i in range(120)))
    assert len(list((tmp_path / "parked").glob("*.park"))) == 1
    follow = ",".join(str(3 + i % 400) for i in range(120)) + "," + ",".join(map(str, first["token_ids"]))
    again = _generate(capsys, *options, "--prompt-token-ids", follow + ",7,8,9")
    fresh = _generate(capsys, *options, "--no-prefix-cache", "--prompt-token-ids", follow + ",7,8,9")
    assert again["token_ids"] == fresh["token_ids"]


@pytest.mark.parametrize(
    ("host", "key", "warned"),
    [
        ("127.0.0.1", None, False),
        ("::1", None, False),
        ("localhost", None, False),
        ("0.0.0.0", None, True),
        ("192.168.1.20", None, True),
        ("workstation.lan", None, True),
        ("0.0.0.0", "secret", False),
    ],
)
def test_serving_beyond_loopback_without_a_key_is_warned_about(
    host: str, key: str | None, warned: bool
) -> None:
    warning = exposure_warning(host, key)
    assert (warning is not None) == warned
    if warning:
        assert host in warning and "--api-key" in warning and "\n" not in warning


def test_spec_tokens_out_of_range_are_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "x", "--spec", "ngram", "--spec-tokens", "0"]) != 0
    assert "--spec-tokens must be 1 to 16" in capsys.readouterr().err


@pytest.mark.parametrize("share", ["-0.5", "1.5"])
def test_a_pcie_share_outside_zero_to_one_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], share: str
) -> None:
    assert main(["generate", "--prompt", "x", "--expert-cache", "2", "--pcie-frac", share]) != 0
    assert capsys.readouterr().err == "strata: error: --pcie-frac must be in [0, 1]\n"


def test_a_stage_outside_the_split_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["stage", "--rendezvous", "tcp://127.0.0.1:1", "--stage", "2", "--stages", "2", "--device", "cpu"]
    assert main(args) == 1
    assert capsys.readouterr().err == "strata: error: --stage must be 1 to 1 (stage 0 is the engine)\n"

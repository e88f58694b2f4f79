"""`strata autoconfig --calibrate`: the choice and its neighbours timed, the fastest kept (and saved)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from checkpoints import write_checkpoint

from app import calibrate as calibration
from app.autoconfig import Settings
from app.calibrate import calibrate, candidates
from app.cli import main


def test_the_candidates_are_the_choice_and_its_neighbours_in_the_same_memory() -> None:
    tier = Settings(parallel=8, kv_memory=1 << 30, expert_cache=32, adapt_async=True, reasons=["rules"])
    found = candidates(tier)
    assert found[0] is tier
    assert [(c.parallel, c.expert_placement, c.adapt_async) for c in found[1:]] == [
        (4, "spread", True),
        (8, "layers", False),
    ]
    assert {c.kv_memory for c in found} == {1 << 30}
    split = Settings(parallel=8, kv_memory=1 << 30, layer_split="2", batch_groups=2)
    assert [c.batch_groups for c in candidates(split)] == [2, 2, 1]
    assert candidates(Settings(parallel=1, kv_memory=1 << 20)) == [Settings(parallel=1, kv_memory=1 << 20)]


def test_calibrate_keeps_the_fastest_and_says_so() -> None:
    chosen = Settings(parallel=8, kv_memory=1 << 30, expert_cache=32, adapt_async=True, reasons=["rules"])
    rates = {(8, "spread"): 300.0, (4, "spread"): 200.0, (8, "layers"): 350.0}
    lines: list[str] = []
    best = calibrate(chosen, lambda c: rates[(c.parallel, c.expert_placement)], lines.append)
    assert (best.parallel, best.expert_placement) == (8, "layers") and len(lines) == 3
    assert best.flags()[-2:] == ["--expert-placement", "layers"]
    assert best.reasons[0] == "rules" and best.reasons[1].startswith("calibrated: 350.0 tok/s")
    tie = calibrate(chosen, lambda c: 100.0, lines.append)
    assert (tie.parallel, tie.expert_placement) == (8, "spread")  # equals: the rules' own choice


def test_autoconfig_calibrates_on_this_machine_and_saves_the_fastest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real engines on a tiny checkpoint: each candidate is timed, and --save writes the fastest."""
    model = write_checkpoint(tmp_path / "model", "qwen3_moe")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(calibration, "CALIBRATE_PROMPT", 16)
    monkeypatch.setattr(calibration, "CALIBRATE_OUTPUT", 8)
    assert main(["autoconfig", "--model", str(model), "--calibrate", "--save"]) == 0
    out = capsys.readouterr().out
    timed = [line for line in out.splitlines() if "tok/s with" in line and "slots busy" in line]
    assert len(timed) == 2  # the choice and half its slots
    assert "- calibrated: " in out
    saved = tomllib.loads((tmp_path / "config" / "strata" / "settings.toml").read_text())["serve"]
    assert saved["model"] == str(model) and int(saved["parallel"]) >= 1
    assert "# - calibrated: " in (tmp_path / "config" / "strata" / "settings.toml").read_text()

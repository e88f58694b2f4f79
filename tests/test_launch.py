"""`strata` alone: autoconfig's settings saved on the first launch, read back later, flags over them, and a
real server started from them."""

from __future__ import annotations

import configparser
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serving import free_port

from app.cli import main
from app.default_model import default_model_dir
from app.errors import StrataError
from app.launch import saved_flags, settings_path


@pytest.fixture
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    return tmp_path


def test_the_first_launch_saves_autoconfigs_settings_and_later_ones_read_them(
    config_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = saved_flags()
    path = settings_path()
    assert path.is_relative_to(config_home) and path.exists()
    assert flags[:2] == ["--model", str(default_model_dir())] and "--parallel" in flags
    assert "first launch on this machine" in capsys.readouterr().out
    text = path.read_text()
    assert text.startswith("# strata's settings") and "[serve]" in text
    assert saved_flags() == flags and "first launch" not in capsys.readouterr().out
    path.write_text(text.replace(f"parallel = {flags[flags.index('--parallel') + 1]}", "parallel = 3"))
    assert saved_flags()[flags.index("--parallel") + 1] == "3"
    path.write_text("[serve\\n")
    with pytest.raises(StrataError, match="delete it to choose again"):
        saved_flags()


def test_strata_alone_serves_with_the_saved_settings(config_home: Path) -> None:
    port = free_port()
    env = {**os.environ, "XDG_CONFIG_HOME": str(config_home), "STRATA_NO_BROWSER": "1"}
    command = [sys.executable, "-m", "app.cli", "launch", "--port", str(port), "--kv-memory", "64MiB"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "strata launch did not become healthy"
            time.sleep(0.2)
        assert (config_home / "strata" / "settings.toml").exists()
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
    finally:
        process.send_signal(signal.SIGINT)  # as Ctrl+C: the server stops its engine process
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_launcher_is_a_desktop_entry_that_runs_strata_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert main(["install-launcher"]) == 0
    path = tmp_path / "applications" / "strata.desktop"
    assert str(path) in capsys.readouterr().out
    entry = configparser.ConfigParser(interpolation=None)
    entry.read(path)
    desktop = entry["Desktop Entry"]
    assert desktop["Type"] == "Application" and desktop["Terminal"] == "true"
    command = shlex.split(desktop["Exec"])
    assert Path(command[0]).exists() and command[1:] == ["-m", "app.cli", "launch"]

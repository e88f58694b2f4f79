"""`strata` alone: the settings saved for this machine, and the chat opened in the browser.

The first launch asks autoconfig (app/autoconfig.py) for the default model's settings on this machine, prints
why it chose each, and writes them to `settings.toml` in the user's config directory (platformdirs:
~/.config/strata on Linux), as `strata serve` flags under `[serve]`, with the reasons as comments. Later
launches read that file (edit it to change them; delete it to choose again); flags given to `strata launch`
override it. `strata install-launcher` puts `strata` alone in the desktop's menu.
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
import tomllib
import webbrowser
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs

from app.errors import StrataError

if TYPE_CHECKING:
    from app.autoconfig import Settings

READY_WAIT_S = 600  # how long the browser waits for the server (a large model loads for minutes)


def settings_path() -> Path:
    """Where the saved settings live."""
    return Path(platformdirs.user_config_dir("strata")) / "settings.toml"


def saved_flags() -> list[str]:
    """The `strata serve` flags of the settings file, written from autoconfig's choice first if missing."""
    path = settings_path()
    if not path.exists():
        _write_autoconfig(path)
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8")).get("serve", {})
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise StrataError(f"cannot read the settings in {path}: {e} (delete it to choose again)") from None
    flags = []
    for key, value in table.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def _write_autoconfig(path: Path) -> None:
    """Autoconfig's settings for the default model on this machine, printed with their reasons and written
    to `path`."""
    from app.autoconfig import for_model
    from app.default_model import default_model_dir

    model = str(default_model_dir())
    machine, settings = for_model(model)
    print(f"strata: first launch on this machine ({machine.describe()}):")
    for reason in settings.reasons:
        print(f"  - {reason}")
    write_settings(path, model, settings)


def write_settings(path: Path, model: str, settings: Settings) -> None:
    """Write `settings` for `model` to the settings file at `path`, their reasons as comments."""
    lines = [
        "# strata's settings on this machine, as `strata serve` flags (chosen by `strata autoconfig`):",
        *(f"# - {reason}" for reason in settings.reasons),
        "[serve]",
        f"model = {_toml(model)}",
    ]
    for name, value in settings.options().items():
        lines.append(f"{name.replace('-', '_')} = {'true' if value is True else _toml(str(value))}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"strata: saved to {path} (edit it to change them, delete it to choose again)")


def _toml(value: str) -> str:
    """A flag's value as TOML: an integer as it is, anything else a quoted string."""
    if value.isdigit():
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def install_launcher() -> Path:
    """Write a desktop entry (Linux: `$XDG_DATA_HOME/applications/strata.desktop`) that runs `strata` alone
    in a terminal, so the desktop's menu starts the server and opens the chat; returns its path."""
    if not sys.platform.startswith("linux"):
        raise StrataError("install-launcher writes a Linux desktop entry; here, run `strata` instead")
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    path = data / "applications" / "strata.desktop"
    command = shlex.join([sys.executable, "-m", "app.cli", "launch"])
    entry = [
        "[Desktop Entry]",
        "Type=Application",
        "Name=Strata",
        "Comment=Serve a Mixture-of-Experts model on this machine and chat with it in the browser",
        f"Exec={command}",
        "Terminal=true",
        "Categories=Development;",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(entry) + "\n", encoding="utf-8")
    return path


def browser_when_ready(host: str, port: int) -> threading.Thread:
    """Open the chat in the browser once the server on host:port answers /health (a daemon thread)."""
    import httpx

    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{port}/"

    def wait_then_open() -> None:
        deadline = time.monotonic() + READY_WAIT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "health", timeout=1).status_code == 200:
                    webbrowser.open(url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    thread = threading.Thread(target=wait_then_open, name="strata-browser", daemon=True)
    thread.start()
    return thread

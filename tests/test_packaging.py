"""A non-editable install of the package (what `pip install .` makes) serves the chat and Monitor pages: the
templates and static files travel inside it, as does the CUDA kernels' source. It runs as `make run` installs
it on a machine without an NVIDIA GPU: torch's CPU build, which brings no Triton."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
from checkpoints import write_checkpoint
from serving import start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("app", "webui", "templates", "static", "native", "setup.py", "pyproject.toml", "README.md")


def test_an_installed_package_serves_the_chat_and_monitor_pages(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the repository
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name)
    installed = tmp_path / "site"
    env = {**os.environ, "STRATA_NO_NATIVE": "1"}  # the kernels' build is not what this checks
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(installed),
            str(source),
        ],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    shutil.rmtree(source)  # the installed copy alone from here on
    assert (installed / "webui" / "templates" / "chat.html").is_file()
    assert (installed / "webui" / "static" / "chat.js").is_file()
    assert (installed / "app" / "kernels" / "held_experts.cu").is_file()  # the CUDA kernels compile from it
    no_triton = tmp_path / "no-triton" / "triton"  # `import triton` fails, as without the package
    no_triton.mkdir(parents=True)
    (no_triton / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'triton'\")\n")
    run_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(no_triton.parent), str(installed)])}
    where = subprocess.run(
        [sys.executable, "-c", "import app, webui.pages as p; print(app.__file__); print(p.TEMPLATES_DIR)"],
        check=True,
        capture_output=True,
        text=True,
        env=run_env,
        cwd=tmp_path,
    ).stdout.split()
    assert all(Path(path).is_relative_to(installed) for path in where)
    server = start_server(write_checkpoint(tmp_path / "model", "qwen3_moe"), env=run_env, cwd=tmp_path)
    try:
        for path, text in (("/", "chat.js"), ("/monitor", "monitor.js"), ("/static/chat.js", "")):
            answer = httpx.get(server.url + path, timeout=10)
            assert answer.status_code == 200 and text in answer.text
        body = {"model": "model", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        completion = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
    finally:
        stop_server(server)

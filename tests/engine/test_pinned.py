"""How the engine process pins host memory: by registering touched pages, unless the user said otherwise."""

from __future__ import annotations

import os

import pytest

from app.engine.pinned import PINNED_BY_REGISTER, pin_by_registering


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (None, PINNED_BY_REGISTER),
        ("expandable_segments:True", f"expandable_segments:True,{PINNED_BY_REGISTER}"),
        ("pinned_use_cuda_host_register:False", "pinned_use_cuda_host_register:False"),
    ],
)
def test_pinning_by_registering_joins_the_users_allocator_settings(
    monkeypatch: pytest.MonkeyPatch, before: str | None, after: str
) -> None:
    if before is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", before)
    pin_by_registering()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == after

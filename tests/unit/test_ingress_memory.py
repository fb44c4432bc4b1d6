"""The ingress maps large blocks apart, so that memory slow bodies held goes back."""

from __future__ import annotations

import ctypes
import gc
import sys

import pytest
import structlog

import ingress.main
from ingress import memory
from ingress.main import app_from_env


def test_the_threshold_is_set_under_glibc() -> None:
    libc = ctypes.CDLL(None)
    glibc = sys.platform.startswith("linux") and hasattr(libc, "gnu_get_libc_version")
    assert memory.map_large_blocks_apart() is glibc


def test_elsewhere_nothing_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert memory.map_large_blocks_apart() is False


def test_the_app_factory_maps_large_blocks_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(ingress.main, "map_large_blocks_apart", lambda: calls.append(True))
    monkeypatch.setenv("DATABASE_URL", "postgresql://payhook@127.0.0.1:5432/payhook")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/15")
    try:
        app_from_env()  # builds without I/O
    finally:
        gc.unfreeze()
        structlog.reset_defaults()  # the factory configured logging
    assert calls == [True]

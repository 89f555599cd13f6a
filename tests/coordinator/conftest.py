"""Coordinator servers over real loopback HTTP, one per test module (fast, isolated enough:
tests use fresh instance ids, models and tokens so they never see each other's keys)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvatlas.coordinator.server import BackgroundServer
from tests.coordinator.helpers import running


@pytest.fixture(scope="module")
def blend_server() -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    """Blend lookup on, default limits."""
    with running(enable_blend_lookup=True) as pair:
        yield pair


@pytest.fixture(scope="module")
def server(blend_server: tuple[BackgroundServer, httpx.Client]) -> BackgroundServer:
    return blend_server[0]


@pytest.fixture(scope="module")
def client(blend_server: tuple[BackgroundServer, httpx.Client]) -> httpx.Client:
    return blend_server[1]

"""What vLLM 0.33 does on the wire that a black-box probe caught engine-sim not doing (real
processes on loopback): a non-streamed request whose client leaves is aborted (vLLM's
``with_cancellation``)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import wait_for
from tests.engine_sim.harness import MODEL, EngineProcess


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_non_streamed_request_whose_client_leaves_is_aborted(path: str) -> None:
    """At ``--speed 1`` 100,000 output tokens take the model about 15 minutes: the request is
    still running when its client gives up, and only its abort frees its slot and blocks."""
    sim = EngineProcess("--speed", "1")
    try:
        free = sim.healthz()["free_blocks"]
        body = {"model": MODEL, "max_tokens": 100_000}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": "go on"}]
        else:
            body["prompt"] = [1, 2, 3]
        with pytest.raises(httpx.ReadTimeout):  # the client leaves (its connection closed)
            httpx.post(sim.url + path, json=body, timeout=httpx.Timeout(10, read=0.5))
        assert wait_for(lambda: sim.healthz()["running"] == 0, 60), sim.healthz()
        health = sim.healthz()
        assert health["waiting"] == 0 and health["free_blocks"] == free
        assert health["scheduler"]["generation_tokens"] < 100_000
    finally:
        sim.close()

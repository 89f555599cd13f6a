"""A node that hangs (stopped: it accepts connections and never answers) must not hold vLLM's
scheduler: ``get_num_new_matched_tokens`` runs in the scheduler's loop for every waiting
request, so its node calls wait ``lookup_timeout_s`` (2 s), not the worker's ``timeout_s``
(30 s, for KV transfers). The old code waited 30 s per lookup, once every ``retry_s``: with
requests arriving, the engine served nothing 30 s of every 35."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kvatlas.connector import ConnectorSettings
from kvatlas.coordinator.server import free_port
from kvatlas.errors import InvalidInput
from kvatlas.processes import stop
from tests.connector.test_connector_node_restart import toy
from tests.connector.test_vllm_connector import tiny_node
from tests.vllm_support import require_vllm


def test_a_hung_node_holds_the_scheduler_for_the_lookup_timeout_only(tmp_path: Path) -> None:
    require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from tests.connector.harness import Engine, make_request

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    node = tiny_node(tmp_path, port, timeout=180)
    try:
        engine = Engine.start(url, toy(16), lookup_timeout_s=None)  # the default, 2 s
        os.kill(node.pid, signal.SIGSTOP)
        try:
            got = engine.scheduler.get_num_new_matched_tokens(make_request("r", list(range(40))), 0)
        finally:
            os.kill(node.pid, signal.SIGCONT)
        assert got == (0, False)  # a miss: vLLM computes the prompt
        # the call that timed out is the scheduler's, whose timeout is the lookup's
        assert engine.scheduler.scheduler.node.failures["lookup"] == 1
        assert engine.scheduler.scheduler.node.timeout_s == 2.0
        assert engine.worker.worker.node.timeout_s == 30.0  # KV transfers keep theirs
        engine.close()
    finally:
        stop([node])


@pytest.mark.parametrize("value", ["2", 0, -1, True, 4000])
def test_lookup_timeout_must_be_seconds(value: object) -> None:
    with pytest.raises(InvalidInput, match="lookup_timeout_s must be seconds"):
        ConnectorSettings.from_extra_config(
            {"node_url": "http://127.0.0.1:9400", "lookup_timeout_s": value}, environ={}
        )
    got = ConnectorSettings.from_extra_config(
        {"node_url": "http://127.0.0.1:9400", "lookup_timeout_s": 0.5}, environ={}
    )
    assert got.lookup_timeout_s == 0.5 and got.timeout_s == 30.0

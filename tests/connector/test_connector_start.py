"""The connector's start-up refusals, as ``vllm serve`` would meet them (vLLM 0.33's
``KVConnectorFactory``): each names what is wrong and where, never a bare library error."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvatlas.coordinator.server import free_port
from kvatlas.errors import Unavailable
from kvatlas.node.config import NodeConfig
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import stop
from tests.connector.test_vllm_connector import tiny_node
from tests.vllm_support import require_vllm


@pytest.fixture(scope="module")
def model() -> ToyRopeModel:
    require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    layout = NodeConfig(
        model_name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, chunk_size=16, dtype="float32"
    ).layout
    return ToyRopeModel(layout, seed=3)


class _NotANode(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"no such page")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def not_a_node() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotANode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_node_down_at_start_is_refused_naming_its_url(model: ToyRopeModel) -> None:
    """Nothing listens at node_url: the engine does not start, and says which node it needed
    (vLLM's traceback showed only httpx's 'ConnectError: [Errno 111] Connection refused')."""
    from tests.connector.harness import Engine

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable, match="kvatlas connector: no layout from the node at") as err:
        Engine.start(url, model)
    assert url in str(err.value) and "ConnectError" in str(err.value)


def test_a_url_that_is_no_node_is_refused_naming_it(model: ToyRopeModel, not_a_node: str) -> None:
    """node_url answers, but not as a node (another service's port): refused naming the URL
    and the answer."""
    from tests.connector.harness import Engine

    with pytest.raises(Unavailable, match="kvatlas connector: no layout from the node at") as err:
        Engine.start(not_a_node, model)
    assert not_a_node in str(err.value) and "404" in str(err.value)


def test_vllms_fail_policy_is_said_at_start(
    model: ToyRopeModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's default kv_load_failure_policy, 'fail', turns every block the connector reports
    as not loaded (a chunk evicted since the lookup, a node gone) into a failed request where
    the connector's promise is a recompute: the connector starts (the policy is the
    operator's) and says so at start, naming the setting. The old code said nothing."""
    from vllm.config import KVTransferConfig

    from tests.connector.harness import Engine

    assert KVTransferConfig().kv_load_failure_policy == "fail"  # vLLM's default
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    node = tiny_node(tmp_path, port)
    try:
        with caplog.at_level(logging.WARNING, logger="kvatlas.connector"):
            Engine.start(url, model, policy="fail").close()
            said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert any("kv_load_failure_policy is 'fail'" in m for m in said), said
            assert any('"kv_load_failure_policy": "recompute"' in m for m in said), said
            caplog.clear()
            Engine.start(url, model, policy="recompute").close()  # the positive control
            assert not [r for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
    finally:
        stop([node])


def test_cuda_graphs_keep_the_layer_hooks() -> None:
    """The connector's loads and saves run in vLLM's per-layer hooks (wait_for_layer_load,
    save_kv_layer), which a FULL CUDA graph replay skips (KVConnectorBase_V1's
    requires_piecewise_for_cudagraph): the connector must ask for PIECEWISE, which vLLM's
    VllmConfig then sets over FULL_AND_PIECEWISE. The old code answered the base's False."""
    require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvatlas.connector import KvatlasConnector

    config = KVTransferConfig(
        kv_connector="KvatlasConnector", kv_connector_module_path="kvatlas.connector",
        kv_role="kv_both", kv_connector_extra_config={"node_url": "http://127.0.0.1:9400"},
    )  # fmt: skip
    cls = KVConnectorFactory.get_connector_class(config)  # what VllmConfig asks
    assert cls is KvatlasConnector
    assert cls.requires_piecewise_for_cudagraph(config.kv_connector_extra_config) is True

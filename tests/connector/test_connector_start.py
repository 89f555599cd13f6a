"""The connector's start-up refusals, as ``vllm serve`` would meet them (vLLM 0.33's
``KVConnectorFactory``): each names what is wrong and where, never a bare library error."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvatlas.coordinator.server import free_port
from kvatlas.errors import Unavailable
from kvatlas.node.config import NodeConfig
from kvatlas.node.toy_model import ToyRopeModel
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

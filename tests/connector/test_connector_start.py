"""The connector's start-up refusals, as ``vllm serve`` would meet them (vLLM 0.33's
``KVConnectorFactory``): each names what is wrong and where, never a bare library error."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvatlas.connector import ConnectorSettings
from kvatlas.coordinator.server import free_port
from kvatlas.errors import InvalidInput, Unavailable
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import stop
from tests.connector.test_vllm_connector import TINY_LLAMA, tiny_node
from tests.vllm_support import require_vllm


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


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:port", "http://"])
def test_a_malformed_node_url_is_refused_naming_it(model: ToyRopeModel, url: str) -> None:
    """A node_url with the http(s) prefix that is no URL (an unclosed IPv6 bracket, a port that
    is no number, no host): refused naming the key and the URL (it escaped as httpx's bare
    'InvalidURL: Invalid port' naming neither)."""
    from tests.connector.harness import Engine

    with pytest.raises(InvalidInput, match=r"kv_connector_extra_config\.node_url") as err:
        Engine.start(url, model)
    assert repr(url) in str(err.value)


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


def test_every_exported_name_resolves() -> None:
    """``kvatlas.connector`` names its exports three times (``__all__``, the type checker's
    imports and the lazy ones, ``_EXPORTS``): each exported name resolves, and the lazy ones
    are exactly the exports but the settings."""
    require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    import kvatlas.connector as package

    assert set(package._EXPORTS) == set(package.__all__) - {"KV_PACKINGS", "ConnectorSettings"}
    for name in package.__all__:
        assert getattr(package, name) is not None, name


@pytest.fixture(scope="module")
def base_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A node started with ``--model-name tiny-base`` (the tiny Llama's shapes)."""
    require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    port = free_port()
    node = tiny_node(tmp_path_factory.mktemp("base"), port, timeout=180, model_name="tiny-base")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop([node])


def test_a_node_of_another_model_is_refused(model: ToyRopeModel, base_node: str) -> None:
    """The node holds KV of model ``tiny-base``; the engine serves a fine-tune of it (the same
    shapes, other weights): every check of shapes passes, and the old code started and loaded
    the base model's KV into the fine-tune's requests. Refused, naming both models and the key
    that says which model the node's KV is; the node's model name must be vLLM's served model
    name or its model (the positive controls start)."""
    from tests.connector.harness import Engine

    with pytest.raises(InvalidInput, match="model_name 'tiny-base'") as err:
        Engine.start(base_node, model, served_model_name="tiny-ft", model_path="/models/tiny-ft")
    said = str(err.value)
    assert base_node in said and "'tiny-ft'" in said and "'/models/tiny-ft'" in said, said
    assert "kv_connector_extra_config.model_name" in said, said
    with pytest.raises(InvalidInput, match="model_name 'tiny-base'"):  # no basename guessing
        Engine.start(base_node, model, served_model_name=None, model_path="/ft/tiny-base/x")
    Engine.start(base_node, model, served_model_name="tiny-base").close()  # --served-model-name
    Engine.start(base_node, model, served_model_name=None, model_path="tiny-base").close()
    Engine.start(base_node, model, served_model_name="alias", model_path="tiny-base").close()


def test_the_model_name_key_is_the_nodes_model(model: ToyRopeModel, base_node: str) -> None:
    """``kv_connector_extra_config.model_name`` says which node model is this engine's (a node
    named otherwise than vLLM's served name): it must be the node's, and it is what counts."""
    from tests.connector.harness import Engine

    with pytest.raises(InvalidInput, match="model_name 'tiny-base'") as err:
        Engine.start(base_node, model, served_model_name="tiny-base", model_name="tiny-ft")
    said = str(err.value)
    assert "'tiny-ft'" in said and "kv_connector_extra_config.model_name" in said, said
    Engine.start(base_node, model, served_model_name="llama-ft", model_name="tiny-base").close()
    # a vLLM config without a model (vLLM's engines always have one): the key is required
    with pytest.raises(InvalidInput, match=r"kv_connector_extra_config\.model_name") as err:
        Engine.start(base_node, model, model_path=None)
    assert "'tiny-base'" in str(err.value)
    Engine.start(base_node, model, model_path=None, model_name="tiny-base").close()


@pytest.mark.parametrize("value", ["", 3, "a@b", True])
def test_the_model_name_key_must_be_a_model_name(value: object) -> None:
    with pytest.raises(InvalidInput, match=r"kv_connector_extra_config\.model_name must be"):
        ConnectorSettings.from_extra_config(
            {"node_url": "http://127.0.0.1:9400", "model_name": value}, environ={}
        )
    got = ConnectorSettings.from_extra_config(
        {"node_url": "http://127.0.0.1:9400", "model_name": "llama-3-8b"}, environ={}
    )
    assert got.model_name == "llama-3-8b"
    unset = {"node_url": "http://127.0.0.1:9400", "model_name": None}  # null: not set
    assert ConnectorSettings.from_extra_config(unset, environ={}).model_name is None


# -- RoPE: with blend, the node re-RoPEs fragments with its own; it must be vLLM's model's ----

OTHER_ROPES = {  # the engine's model (its config.json) against the tiny Llama's node
    "rope_theta": ({"rope_theta": 500000.0}, "rope_theta", "10000.0", "500000.0"),
    "rope_style": (
        {"model_type": "cohere", "architectures": ["CohereForCausalLM"]}, "rope_style",
        "'neox'", "'gptj'",
    ),
    "rotary_dim": ({"partial_rotary_factor": 0.5}, "rotary_dim", "16", "8"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(OTHER_ROPES))
def test_blend_refuses_a_node_that_re_ropes_otherwise(
    model: ToyRopeModel, base_node: str, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The node re-RoPEs fragments with its --rope-theta, --rope-style and --rotary-dim; the
    engine's model (vLLM's hf_config) uses another: every shape and the model name agree, and
    the old code started and loaded fragments rotated to wrong positions. With blend, refused
    naming both values; without blend nothing is re-RoPE'd: it starts, and says the
    difference (a WARNING). The same engine with the node's RoPE starts with blend."""
    from tests.connector.harness import Engine, llama_config

    changes, field, node_value, vllm_value = OTHER_ROPES[case]
    hf = llama_config(model.layout, **changes)
    with pytest.raises(InvalidInput, match=re.escape(f"{field} {node_value}")) as err:
        Engine.start(base_node, model, served_model_name="tiny-base", hf_config=hf, blend=True)
    said = str(err.value)
    assert f"vLLM's model uses {vllm_value}" in said and base_node in said, said
    with caplog.at_level(logging.WARNING, logger="kvatlas.connector"):
        Engine.start(base_node, model, served_model_name="tiny-base", hf_config=hf).close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"{field} {node_value}" in m and "blend" in m for m in warned), warned
    Engine.start(base_node, model, served_model_name="tiny-base", blend=True).close()


SCALED_ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024},
    "linear": {"type": "linear", "factor": 2.0},  # the legacy key
}  # fmt: skip


@pytest.mark.parametrize("rope_type", list(SCALED_ROPES))
def test_blend_refuses_rope_scaling_the_node_cannot_apply(
    model: ToyRopeModel, base_node: str, rope_type: str
) -> None:
    """vLLM's model rescales its RoPE frequencies (rope_scaling); the node re-RoPEs plain RoPE
    only, so every fragment it moves would be rotated wrongly: blend is refused, naming the
    scaling. Without blend, nothing is re-RoPE'd: the engine starts."""
    from tests.connector.harness import Engine, llama_config

    hf = llama_config(model.layout, rope_scaling=SCALED_ROPES[rope_type])
    with pytest.raises(InvalidInput, match=f"rope_type '{rope_type}'") as err:
        Engine.start(base_node, model, served_model_name="tiny-base", hf_config=hf, blend=True)
    assert "blend" in str(err.value) and base_node in str(err.value), str(err.value)
    Engine.start(base_node, model, served_model_name="tiny-base", hf_config=hf).close()


def test_blend_needs_vllms_model_to_read_its_rope(model: ToyRopeModel, base_node: str) -> None:
    """A vLLM config without a model (vLLM's engines always have one) gives no RoPE to compare
    the node's with: blend is refused rather than assumed; without blend it starts."""
    from tests.connector.harness import Engine

    with pytest.raises(InvalidInput, match="RoPE") as err:
        Engine.start(base_node, model, model_path=None, model_name="tiny-base", blend=True)
    assert "blend" in str(err.value), str(err.value)
    Engine.start(base_node, model, model_path=None, model_name="tiny-base").close()


def test_blend_refuses_a_node_started_with_another_rope_theta(
    model: ToyRopeModel, tmp_path: Path
) -> None:
    """The node was started from another model's config.json (rope_theta 500000, a Llama 3):
    the engine's model (rope_theta 10000) is refused with blend, naming both values and the
    node's flag."""
    from tests.connector.harness import Engine

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    node = tiny_node(tmp_path, port, timeout=180, config={**TINY_LLAMA, "rope_theta": 500000.0})
    try:
        with pytest.raises(InvalidInput, match=r"rope_theta 500000\.0") as err:
            Engine.start(url, model, blend=True)
        said = str(err.value)
        assert "vLLM's model uses 10000.0" in said and "--rope-theta" in said, said
        Engine.start(url, model).close()  # no blend: nothing re-RoPE'd
    finally:
        stop([node])


VLLM_ROPES = {  # config.json changes → what vLLM's get_rope builds for a head of 16 dims
    "gptj": (
        {"architectures": ["GPTJForCausalLM"], "model_type": "gptj", "rotary_dim": 8},
        (10000.0, 8, "gptj"),  # the rotated dims: gpt_j.py passes its rotary_dim
    ),
    "stablelm": (
        {"model_type": "stablelm", "partial_rotary_factor": 0.25},
        (10000.0, 4, "neox"),
    ),
    "an int theta": ({"rope_theta": 500000}, (500000.0, 16, "neox")),
    "gemma3": (
        {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"},
        "model_type 'gemma3_text' is not one whose rotary style",
    ),
    "M-RoPE": ({"rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}}, "M-RoPE"),
}


@pytest.mark.parametrize("case", list(VLLM_ROPES))
def test_vllms_rope_is_read_as_get_rope_reads_it(model: ToyRopeModel, case: str) -> None:
    """vLLM's RoPE from its hf_text_config (built by vLLM's get_config), as vLLM's get_rope
    reads it; what is not plain RoPE, or a model type whose rotary style is not known, is a
    reason (blend refused), never a guess."""
    from types import SimpleNamespace

    from kvatlas.connector import Rope, vllm_rope
    from tests.connector.harness import hf_configs, llama_config

    changes, expected = VLLM_ROPES[case]
    _, text = hf_configs(llama_config(model.layout, **changes))
    got = vllm_rope(SimpleNamespace(hf_text_config=text), 16)  # type: ignore[arg-type]
    if isinstance(expected, str):
        assert isinstance(got, str) and expected in got, got
    else:
        assert got == Rope(*expected)

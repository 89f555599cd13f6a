"""``kvatlas engine-sim``: build the engine from its flags and serve it until SIGINT/SIGTERM."""

from __future__ import annotations

import logging

from kvatlas.asgi_thread import bind_listener, serve
from kvatlas.engine_sim.app import create_app
from kvatlas.engine_sim.config import EngineSimConfig
from kvatlas.engine_sim.engine import EngineDriver
from kvatlas.engine_sim.kv_cache import BlockPool
from kvatlas.engine_sim.metrics import EngineMetrics
from kvatlas.engine_sim.node_connector import NodeConnector, TierRates
from kvatlas.engine_sim.publisher import KvEventPublisher
from kvatlas.engine_sim.scheduler import EngineCore
from kvatlas.engine_sim.tokenizer import Tokenizer
from kvatlas.logs import configure_logging, uvicorn_log_options

log = logging.getLogger(__name__)


def build_connector(config: EngineSimConfig) -> NodeConnector | None:
    if config.node_url is None:
        return None
    token = None
    if config.node_token_file is not None:
        token = config.node_token_file.read_text().strip()
    rates = TierRates(
        config.l1_bandwidth_bytes_per_s,
        config.l2_bandwidth_bytes_per_s,
        config.peer_bandwidth_bytes_per_s,
    )
    return NodeConnector(config.node_url, config.model, config.block_size,
                         config.kv_bytes_per_token, rates, config.node_timeout_s, token)  # fmt: skip


def build_driver(config: EngineSimConfig, tokenizer: Tokenizer,
                 publisher: KvEventPublisher | None) -> EngineDriver:  # fmt: skip
    pool = BlockPool(config.gpu_blocks, config.block_size, config.cpu_blocks)
    core = EngineCore(pool, config.cost_model(), config.max_num_batched_tokens,
                      config.max_num_seqs, tokenizer.output_vocab)  # fmt: skip
    return EngineDriver(core, config.speed, EngineMetrics(config.model), publisher,
                        build_connector(config))  # fmt: skip


def run_engine_sim(config: EngineSimConfig) -> int:
    configure_logging(config.log_level, config.log_format)
    try:
        tokenizer = Tokenizer.from_file(config.tokenizer)
        sock = bind_listener(config.host, config.port)
    except (ValueError, OSError) as exc:
        log.error("%s; not starting", exc)
        return 1
    publisher = None
    if config.kv_events_endpoint is not None:
        publisher = KvEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint,
                                     config.topic, config.kv_events_buffer_steps)  # fmt: skip
        try:
            publisher.start()
        except Exception as exc:  # zmq.ZMQError: an endpoint taken or malformed
            log.error("KV events on %s: %s; not starting", config.kv_events_endpoint, exc)
            sock.close()
            return 1
    try:
        driver = build_driver(config, tokenizer, publisher)
    except OSError as exc:  # the node token file
        log.error("%s; not starting", exc)
        if publisher is not None:
            publisher.close()
        sock.close()
        return 1
    log.info("kvatlas engine-sim %s on http://%s:%d (%d GPU blocks of %d, %d CPU, speed %g, "
             "events %s)", config.model, config.host, config.port, config.gpu_blocks,
             config.block_size, config.cpu_blocks, config.speed,
             config.kv_events_endpoint or "off")  # fmt: skip
    try:
        serve(create_app(config, driver, tokenizer), host=config.host, port=config.port,
              sock=sock, **uvicorn_log_options(config.log_level, False))  # fmt: skip
    finally:
        if publisher is not None:
            publisher.close()
        if driver.connector is not None:
            driver.connector.close()
        sock.close()
    return 0

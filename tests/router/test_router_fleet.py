"""``kvatlas router`` against real processes on loopback (issue 26 items 1, 4, 5, 8): a
coordinator subscribed to two fake vLLM engines' KV events (``tests/router/fake_vllm.py``), the
router as its own process in front of them. Routing to the holder (token ids, and chat text
tokenized by the router exactly as the engine does, or the keys would not match), streaming
passed through as it comes and byte for byte, OpenAI errors for every bad input, auth with
salt-bound route tokens, a refusal retried once on the next engine, engines out of the set
until they recover."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.client import RouteClient
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, wait_for
from tests.coordinator.security_support import bearer, spawn_coordinator, token, write_tokens
from tests.router.fake_vllm import FakeVllm, load_hf_tokenizer
from tests.router.tokenizer_support import train_tokenizer
from tests.vllm_oracle import vllm_answer

MODEL = "toy"
ENGINES = ("pod-a", "pod-b")
ROUTE_ANY, ROUTE_A, LOOKUP = token("route-any"), token("route-a"), token("lookup")
ADMIN = token("admin")


def spawn_router(port: int, *flags: str) -> subprocess.Popen[bytes]:
    return spawn_service(
        ["-m", "kvatlas.cli", "router", "--port", str(port), "--log-level", "warning", *flags],
        f"http://127.0.0.1:{port}",
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fleet")
    tok_dir = train_tokenizer(tmp / "tok")
    hf = load_hf_tokenizer(tok_dir)
    engines = {name: FakeVllm(name, MODEL, tokenizer=hf, max_model_len=256) for name in ENGINES}
    tokens = write_tokens(
        tmp / "router-tokens.json",
        {"token": ROUTE_ANY, "roles": ["route"]},
        {"token": ROUTE_A, "roles": ["route"], "cache_salts": ["", "tenant-a"]},
        {"token": LOOKUP, "roles": ["lookup"]},
        {"token": ADMIN, "roles": ["admin"]},
    )
    coord_port, router_port = free_port(), free_port()
    coord = f"http://127.0.0.1:{coord_port}"
    subscribe = ",".join(f"{n}={e.kv.endpoint}" for n, e in engines.items())
    replay = ",".join(e.kv.replay_endpoint for e in engines.values())
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(spawn_coordinator(coord_port, "--chunk-size", "16", "--instance-timeout",
                                       "600", "--kv-events-subscribe", subscribe,
                                       "--kv-events-replay", replay))  # fmt: skip
        engine_flags = [f for n, e in engines.items() for f in ("--engine", f"{n}={e.url}")]
        procs.append(spawn_router(router_port, "--coordinator-url", coord, *engine_flags,
                                  "--tokenizer", str(tok_dir), "--auth-token-file", str(tokens),
                                  "--health-interval-s", "0.2", "--metrics-interval-s", "0.2",
                                  "--max-body-bytes", "65536"))  # fmt: skip
        yield {"coordinator": coord, "router": f"http://127.0.0.1:{router_port}",
               "engines": engines, "flags": engine_flags, "tok": tok_dir}  # fmt: skip
    finally:
        stop(procs)
        for engine in engines.values():
            engine.close()


def post(fleet: dict[str, Any], path: str, body: Any, auth: str | None = ROUTE_ANY,
         router: str | None = None) -> httpx.Response:  # fmt: skip
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **(bearer(auth) if auth else {})}
    return httpx.post(
        f"{router or fleet['router']}{path}", content=raw, headers=headers, timeout=30
    )


def metric(fleet: dict[str, Any], name: str, router: str | None = None) -> float:
    text = HTTP.get(f"{router or fleet['router']}/metrics", headers=bearer(ADMIN)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))  # fmt: skip


def holder_known(fleet: dict[str, Any], holder: str, tokens: list[int], salt: str = "") -> bool:
    """The coordinator ranks ``holder`` first for ``tokens`` (the holder's last batch is sent
    again meanwhile: ZMQ drops what a subscriber joining late never saw)."""
    engine = fleet["engines"][holder]

    def ranked_first() -> bool:
        engine.republish()
        with RouteClient(fleet["coordinator"]) as client:
            scores = client.score(tokens, MODEL, cache_salt=salt)
        return scores.best == holder and scores.instances[0].prefix_tokens > 0

    return wait_for(ranked_first, timeout=30)


def test_token_ids_route_to_the_holder(fleet: dict[str, Any]) -> None:
    doc = list(range(300, 364))  # 64 tokens: 8 engine blocks, 4 fleet chunks
    first = post(fleet, "/v1/completions", {"model": MODEL, "prompt": [*doc, 1, 2]})
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvatlas-engine"]
    assert holder in ENGINES
    assert holder_known(fleet, holder, doc)
    before = metric(fleet, "kvatlas_router_reported_reused_tokens_total")
    for i in range(6):  # by load alone each would be a coin toss: 1/64 to pass by luck
        reply = post(fleet, "/v1/completions", {"model": MODEL, "prompt": [*doc, 7, i]})
        assert (reply.status_code, reply.headers["x-kvatlas-engine"]) == (200, holder)
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # counted when each relay ends, just after its last byte went out
    reported = "kvatlas_router_reported_reused_tokens_total"
    assert wait_for(lambda: metric(fleet, reported) - before == 6 * 64, timeout=10)
    assert metric(fleet, 'kvatlas_router_predicted_reused_tokens_total{engine="' + holder) >= 6 * 64


def test_chat_text_routes_to_the_holder(fleet: dict[str, Any]) -> None:
    """The router tokenizes the chat itself: its keys match the engine's only if its ids do."""
    system = {"role": "system", "content": "the quick brown fox jumps, 1 2 3 " * 20}
    first = post(fleet, "/v1/chat/completions",
                 {"model": MODEL, "messages": [system, {"role": "user", "content": "hello"}]})  # fmt: skip
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvatlas-engine"]
    engine_tokens = fleet["engines"][holder].requests[-1][2]
    assert holder_known(fleet, holder, engine_tokens[:64])
    for i in range(6):
        body = {"model": MODEL, "messages": [system, {"role": "user", "content": f"dog {i}"}]}
        reply = post(fleet, "/v1/chat/completions", body)
        assert (reply.status_code, reply.headers["x-kvatlas-engine"]) == (200, holder)
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert len(engine_tokens) > 100


def test_stream_passes_through_as_it_comes(fleet: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": list(range(900, 940)), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    engines = fleet["engines"].values()
    for engine in engines:
        engine.release.clear()  # each engine holds its stream after the first chunk
    try:
        with httpx.stream("POST", f"{fleet['router']}/v1/completions", json=body,
                          headers=bearer(ROUTE_ANY), timeout=30) as reply:  # fmt: skip
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            chunks = reply.iter_raw()
            got = next(chunks)  # arrives while the engine still holds the rest
            assert got.startswith(b"data: ") and b'"t0"' in got
            for engine in engines:
                engine.release.set()
            got += b"".join(chunks)
            chosen = fleet["engines"][reply.headers["x-kvatlas-engine"]]
    finally:
        for engine in engines:
            engine.release.set()
    direct = httpx.post(f"{chosen.url}/v1/completions", json=body, timeout=30).content
    # byte for byte what the engine sends (the second time the prompt is cached: 40 → 40)
    assert got.replace(b'"cached_tokens": 0', b'"cached_tokens": 40') == direct
    assert got.endswith(b"data: [DONE]\n\n")


def test_bodies_go_to_the_engine_unchanged(fleet: dict[str, Any]) -> None:
    raw = b'{"model":"toy",  "prompt":[5,6,7],"temperature":0.5,"x_custom":{"k":[1]}}'
    reply = post(fleet, "/v1/completions", raw)
    engine = fleet["engines"][reply.headers["x-kvatlas-engine"]]
    assert engine.requests[-1][1] == raw


def test_an_engines_error_passes_through(fleet: dict[str, Any]) -> None:
    reply = post(fleet, "/v1/completions", {"model": MODEL, "prompt": [1, 2], "temperature": -1})
    engine = fleet["engines"][reply.headers["x-kvatlas-engine"]]
    direct = httpx.post(f"{engine.url}/v1/completions",
                        json={"model": MODEL, "prompt": [1, 2], "temperature": -1})  # fmt: skip
    assert (reply.status_code, reply.content) == (400, direct.content)


def test_a_client_leaving_mid_stream_frees_the_engine(fleet: dict[str, Any]) -> None:
    """The client goes after the first event while the engine still holds the rest: the
    router's count of requests in flight returns to zero (no leak, no hang), and the reply
    is counted as aborted, not as a whole reply in ``kvatlas_router_e2e_seconds`` (it was
    counted there, and ``aborted_streams`` only counted engines' cuts)."""
    body = {"model": MODEL, "prompt": list(range(40, 60)), "stream": True}
    engines = fleet["engines"].values()
    for engine in engines:
        engine.release.clear()
    aborted = metric(fleet, "kvatlas_router_aborted_streams_total")
    finished = metric(fleet, "kvatlas_router_e2e_seconds_count")

    def in_flight(name: str) -> int:
        return int(HTTP.get(f"{fleet['router']}/healthz").json()["engines"][name]["in_flight"])

    try:
        with httpx.stream("POST", f"{fleet['router']}/v1/completions", json=body,
                          headers=bearer(ROUTE_ANY), timeout=30) as reply:  # fmt: skip
            chosen = reply.headers["x-kvatlas-engine"]
            chunks = reply.iter_raw()
            assert next(chunks).startswith(b"data: ")
            assert in_flight(chosen) == 1  # the engine still holds the rest
            reply.close()  # the client leaves
            assert wait_for(lambda: in_flight(chosen) == 0, timeout=10)
        assert metric(fleet, "kvatlas_router_aborted_streams_total") == aborted + 1
        assert metric(fleet, "kvatlas_router_e2e_seconds_count") == finished
    finally:
        for engine in engines:
            engine.release.set()


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "JSON decode error"),
        (b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 422, "nests too deeply"),
        (b'{"model": "m", "x": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001, 422, "nests too deeply"),
        ({"prompt": [1, 2]}, 400, "'model' is required"),
        ({"model": "no-such-model", "prompt": [1, 2]}, 404, "does not exist"),
        ({"model": MODEL, "prompt": ""}, 400, "empty"),
        ({"model": MODEL, "prompt": []}, 400, "empty"),
        ({"model": MODEL, "prompt": list(range(300))}, 400, "maximum context length is 256"),
        ({"model": MODEL, "prompt": [1] * 200, "max_tokens": 257}, 400, "max_model_len=256"),
        ({"model": MODEL, "prompt": [1] * 256, "max_tokens": 1}, 400, "at least 1, got 0"),
        ({"model": MODEL, "prompt": [1] * 30000}, 413, "exceeds 65536"),
    ],
)
def test_bad_input_gets_an_openai_error(fleet: dict[str, Any], body: Any, status: int,
                                        message: str) -> None:  # fmt: skip
    reply = post(fleet, "/v1/completions", body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert message in error["message"]
    assert (error["code"], isinstance(error["type"], str)) == (status, True)


def test_a_model_no_engine_serves_is_refused_as_vllm_refuses_it(fleet: dict[str, Any]) -> None:
    """vLLM 0.33's ``_check_model``: 404 ``NotFoundError``, ``param`` ``model``, the served
    names listed (here every engine's)."""
    reply = post(fleet, "/v1/completions", {"model": "no-such-model", "prompt": [1, 2]})
    assert (reply.status_code, reply.json()) == (404, {"error": {
        "message": f"The model `no-such-model` does not exist. Valid aliases: {MODEL}.",
        "type": "NotFoundError", "param": "model", "code": 404}})  # fmt: skip


@pytest.mark.parametrize(
    "body",
    [b"{not json", b'{"model": "toy", "prompt": [1, 2], "max_tokens": "x"}', b'{"model": "toy"}',
     b'{"model": "toy", "prompt": [1, -2], "stream": "maybe"}'],
)  # fmt: skip
def test_a_body_vllm_refuses_is_refused_in_vllms_words(fleet: dict[str, Any], body: bytes) -> None:
    """Its ``type`` (``"Bad Request"`` for what FastAPI refuses), ``param`` and message, as
    vLLM 0.33's server answers (tests/router/test_vllm_validation.py has more)."""
    expected = vllm_answer("/v1/completions", body, "application/json")
    reply = post(fleet, "/v1/completions", body)
    assert (reply.status_code, reply.json()) == (400, expected.json())


@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        ("/v1/completions", {"prompt": list(range(300))},
         "This model's maximum context length is 256 tokens. However, your prompt contains 300 "
         "input tokens, which exceeds this limit even without any output tokens. Please reduce "
         "the length of the input prompt. (parameter=input_tokens, value=300)", "input_tokens"),
        ("/v1/completions", {"prompt": [1] * 200, "max_tokens": 257},
         "max_tokens=257 cannot be greater than max_model_len=256. Please request fewer output "
         "tokens. (parameter=max_tokens, value=257)", "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 10, "max_completion_tokens": 300},
         "max_completion_tokens=300 cannot be greater than max_model_len=256. Please request "
         "fewer output tokens. (parameter=max_completion_tokens, value=300)",
         "max_completion_tokens"),
        ("/v1/completions", {"prompt": [1] * 256},
         "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens"),
    ],
)  # fmt: skip
def test_a_request_no_engine_can_serve_is_refused_in_vllms_words(
    fleet: dict[str, Any], path: str, body: dict[str, Any], message: str, param: str
) -> None:
    """What every engine would refuse (vLLM 0.33, ``kvatlas.vllm_limits``), the router refuses
    with the engine's message and ``param``: a chat's ``max_completion_tokens`` named as such
    (the router said ``max_tokens=``), a prompt over the context or filling it in vLLM's words."""
    error = post(fleet, path, {"model": MODEL, **body}).json()["error"]
    assert (error["message"], error["param"], error["code"]) == (message, param, 400)


def test_an_unknown_path_or_method_gets_an_openai_error(fleet: dict[str, Any]) -> None:
    """docs/router.md, "Endpoints": errors the router raises itself are OpenAI error objects;
    an unknown path and a wrong method were Starlette's ``text/plain`` 404 and 405."""
    for method, path, status in (("GET", "/v1/nothing", 404), ("PUT", "/v1/completions", 405)):
        reply = HTTP.request(method, f"{fleet['router']}{path}", headers=bearer(ROUTE_ANY))
        assert reply.status_code == status, reply.text
        assert reply.headers["content-type"] == "application/json"
        assert reply.json()["error"]["code"] == status
    assert reply.headers["allow"] == "POST"  # (the 405's header stays)


@pytest.mark.parametrize(
    "raw",
    [
        b"NOT AN HTTP REQUEST\r\n\r\n",  # the request line
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",  # a header
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",  # a header's value
    ],
    ids=["request-line", "header", "header-value"],
)
def test_a_request_the_parser_cannot_read_gets_an_openai_400(
    fleet: dict[str, Any], raw: bytes
) -> None:
    """docs/router.md, "Endpoints": uvicorn answered a request it cannot parse with its own
    ``text/plain`` 400 ("Invalid HTTP request received."); the router's guard writes it as an
    OpenAI error object, and the connection is closed. Negative control: the router answers."""
    port = int(fleet["router"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(raw)
        reply = b""
        while part := conn.recv(65536):  # to the close (a hang: the socket's timeout)
            reply += part
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), reply[:300]
    assert b"content-type: application/json" in head.lower().split(b"\r\n"), head
    error = json.loads(body)["error"]
    assert (error["code"], error["type"], error["param"]) == (400, "BadRequestError", None)
    assert "Invalid HTTP request" in error["message"]
    assert HTTP.get(f"{fleet['router']}/healthz").status_code == 200


def test_a_body_nested_too_deeply_is_a_422_counted_never_a_500(fleet: dict[str, Any]) -> None:
    """msgspec, like ``json``, gives up after about a thousand levels with a RecursionError;
    the router answers as the coordinator and the node do (it was a 500 with a traceback)."""
    name = 'kvatlas_http_refused_total{reason="nested_too_deep"}'
    before = metric(fleet, name)
    deep = b'{"model": "toy", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    reply = post(fleet, "/v1/chat/completions", deep)
    assert (reply.status_code, reply.json()["error"]["code"]) == (422, 422)
    assert metric(fleet, name) == before + 1


def test_auth_and_salts(fleet: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3]}
    assert post(fleet, "/v1/completions", body, auth=None).status_code == 401
    assert post(fleet, "/v1/completions", body, auth="x" * 40).status_code == 401
    assert post(fleet, "/v1/completions", body, auth=LOOKUP).status_code == 403  # not route
    assert post(fleet, "/v1/completions", {**body, "cache_salt": "tenant-b"},
                auth=ROUTE_A).status_code == 403  # fmt: skip
    assert post(fleet, "/v1/completions", {**body, "cache_salt": "tenant-a"},
                auth=ROUTE_A).status_code == 200  # fmt: skip
    assert httpx.get(f"{fleet['router']}/v1/models").status_code == 401
    models = httpx.get(f"{fleet['router']}/v1/models", headers=bearer(ROUTE_A)).json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, 256)]
    for m in models["data"]:  # OpenAI's Model object: id, object, created (an int), owned_by
        assert (m["object"], type(m["created"]), type(m["owned_by"])) == ("model", int, str)
    assert httpx.get(f"{fleet['router']}/metrics").status_code == 401
    assert httpx.get(f"{fleet['router']}/metrics", headers=bearer(ROUTE_ANY)).status_code == 403
    two = [("content-type", "application/json"), *[("authorization", f"Bearer {t}")
           for t in (ROUTE_ANY, LOOKUP)]]  # fmt: skip
    for headers in (two, [two[0], two[2], two[1]]):  # two credentials: refused, either order
        r = httpx.post(f"{fleet['router']}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert httpx.get(f"{fleet['router']}/v1/models", headers=headers).status_code == 401
        assert httpx.get(f"{fleet['router']}/metrics", headers=headers).status_code == 401


def test_a_salt_scores_only_its_own_copies(fleet: dict[str, Any]) -> None:
    """The engines' copies sit under salt "" (vLLM has no kvatlas salt): a request under
    tenant-a's salt is predicted to reuse none of them, the same request unsalted all."""
    doc = list(range(500, 564))
    first = post(fleet, "/v1/completions", {"model": MODEL, "prompt": doc})
    assert holder_known(fleet, first.headers["x-kvatlas-engine"], doc)
    name = "kvatlas_router_predicted_reused_tokens_total"
    before = metric(fleet, name)
    salted = post(fleet, "/v1/completions",
                  {"model": MODEL, "prompt": doc, "cache_salt": "tenant-a"}, auth=ROUTE_A)  # fmt: skip
    assert salted.status_code == 200  # (a refused request would leave the counter still too)
    assert metric(fleet, name) == before
    plain = post(fleet, "/v1/completions", {"model": MODEL, "prompt": doc}, auth=ROUTE_A)
    assert plain.status_code == 200
    assert metric(fleet, name) == before + 64


def test_refusal_is_retried_once_and_the_engine_recovers(fleet: dict[str, Any]) -> None:
    """A second router that checks health only at start: it still believes in the holder when
    the holder goes down, so the request is refused, retried on the other engine, and the
    holder leaves the set. The fleet's router (checks every 0.2 s) sees it come back."""
    doc = list(range(700, 764))
    first = post(fleet, "/v1/completions", {"model": MODEL, "prompt": doc})
    holder = first.headers["x-kvatlas-engine"]
    other = next(n for n in ENGINES if n != holder)
    assert holder_known(fleet, holder, doc)
    port = free_port()
    lazy = f"http://127.0.0.1:{port}"
    proc = spawn_router(port, "--coordinator-url", fleet["coordinator"], *fleet["flags"],
                        "--health-interval-s", "3600")  # fmt: skip
    try:
        assert post(fleet, "/v1/completions", {"model": MODEL, "prompt": [*doc, 9]},
                    router=lazy).headers["x-kvatlas-engine"] == holder  # fmt: skip
        fleet["engines"][holder].stop()
        reply = post(fleet, "/v1/completions", {"model": MODEL, "prompt": [*doc, 8]}, router=lazy)
        assert (reply.status_code, reply.headers["x-kvatlas-engine"]) == (200, other)
        assert metric(fleet, "kvatlas_router_retries_total", router=lazy) == 1
        health = httpx.get(f"{lazy}/healthz").json()["engines"]
        assert (health[holder]["healthy"], health[other]["healthy"]) == (False, True)
        reply = post(fleet, "/v1/completions", {"model": MODEL, "prompt": [*doc, 7]}, router=lazy)
        assert reply.headers["x-kvatlas-engine"] == other
        assert metric(fleet, "kvatlas_router_retries_total", router=lazy) == 1  # out of the set
        # no engine left: 503, an OpenAI error, no hang
        fleet["engines"][other].healthy = False
        assert wait_for(lambda: HTTP.get(f"{fleet['router']}/healthz").status_code == 503, 10)
        down = post(fleet, "/v1/completions", {"model": MODEL, "prompt": [1]})
        assert (down.status_code, down.json()["error"]["code"]) == (503, 503)
    finally:
        stop([proc])
        fleet["engines"][other].healthy = True
        fleet["engines"][holder].restart()

    def healthy(name: str) -> bool:
        return bool(HTTP.get(f"{fleet['router']}/healthz").json()["engines"][name]["healthy"])

    assert wait_for(lambda: healthy(holder) and healthy(other), timeout=10)
    assert metric(fleet, "kvatlas_router_engines_out") == 0


@contextlib.contextmanager
def listed_engine_router(fleet: dict[str, Any], name: str) -> Iterator[str]:
    """A router run with ``--engines-from-coordinator`` (its URL) whose one engine ``name`` is
    registered with the coordinator under ``metadata.openai_url``, and has served a request."""
    from kvatlas.client import CoordinatorClient

    extra = FakeVllm(name, MODEL, max_model_len=256)
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    client = CoordinatorClient(fleet["coordinator"])
    client.register(name, metadata={"openai_url": extra.url})
    proc = spawn_router(port, "--coordinator-url", fleet["coordinator"],
                        "--engines-from-coordinator", "--policy", "least-loaded",
                        "--health-interval-s", "0.2")  # fmt: skip
    try:
        reply = post(fleet, "/v1/completions", {"model": MODEL, "prompt": [1, 2]}, router=router)
        assert (reply.status_code, reply.headers["x-kvatlas-engine"]) == (200, name)
        yield router
    finally:
        stop([proc])
        client.close()
        extra.close()


def test_engines_from_the_coordinator(fleet: dict[str, Any]) -> None:
    """An instance registered with ``metadata.openai_url`` is an engine of a router run with
    ``--engines-from-coordinator``; deregistered, it leaves the set."""
    with listed_engine_router(fleet, "pod-c") as router:
        engines = httpx.get(f"{router}/healthz").json()["engines"]
        assert set(engines) == {"pod-c"}  # pod-a, pod-b: no URL known to the coordinator
        httpx.delete(f"{fleet['coordinator']}/instances/pod-c")
        assert wait_for(lambda: HTTP.get(f"{router}/healthz").status_code == 503, timeout=10)
        gone = post(fleet, "/v1/completions", {"model": MODEL, "prompt": [1, 2]}, router=router)
        assert gone.status_code == 503


def test_multimodal_and_untokenized_requests_are_routed_by_load_and_counted(
    fleet: dict[str, Any],
) -> None:
    name = 'kvatlas_router_untokenized_total{reason="multimodal"}'
    before = metric(fleet, name)
    parts = [{"type": "text", "text": "what is this"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]  # fmt: skip
    reply = post(fleet, "/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": parts}]})  # fmt: skip
    assert reply.status_code == 200
    assert metric(fleet, name) == before + 1


def test_the_prefix_baseline_also_routes_to_the_holder(fleet: dict[str, Any]) -> None:
    """``--policy prefix`` (llm-d's scoring) on the same fleet: a consecutive prefix is what it
    sees best, so it too sends the document's requests to their holder."""
    doc = list(range(1100, 1164))
    first = post(fleet, "/v1/completions", {"model": MODEL, "prompt": doc})
    holder = first.headers["x-kvatlas-engine"]
    assert holder_known(fleet, holder, doc)
    port = free_port()
    proc = spawn_router(port, "--coordinator-url", fleet["coordinator"], *fleet["flags"],
                        "--policy", "prefix")  # fmt: skip
    try:
        for i in range(6):
            reply = post(fleet, "/v1/completions", {"model": MODEL, "prompt": [*doc, i]},
                         router=f"http://127.0.0.1:{port}")  # fmt: skip
            assert (reply.status_code, reply.headers["x-kvatlas-engine"]) == (200, holder)
    finally:
        stop([proc])


def test_an_engine_that_left_the_set_leaves_no_series_behind(fleet: dict[str, Any]) -> None:
    """An engine listed by the coordinator that deregisters takes its labelled series with it
    (``kvatlas_router_decisions_total{engine}`` and the token counters): a fleet whose engines
    come and go under new ids (pods) must not grow the router's ``/metrics`` for ever (the old
    router kept every engine's series it had ever routed to)."""
    with listed_engine_router(fleet, "pod-gone") as router:
        assert 'engine="pod-gone"' in HTTP.get(f"{router}/metrics").text
        httpx.delete(f"{fleet['coordinator']}/instances/pod-gone")
        assert wait_for(lambda: HTTP.get(f"{router}/healthz").status_code == 503, timeout=10)
        text = HTTP.get(f"{router}/metrics").text
        assert "pod-gone" not in text
        assert "kvatlas_router_decisions_total" in text  # the family stays, without the engine

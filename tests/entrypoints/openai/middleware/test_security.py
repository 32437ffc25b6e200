"""API keys, TLS and CORS (``pyxllm serve --api-key/--ssl-*/--allowed-origins``): flags, the
middleware on a small app, and two real servers, one with keys, CORS and ``--protect-metrics``,
one serving HTTPS with client certificates and keys from ``$PYXLLM_API_KEY``."""

from __future__ import annotations

import ssl
import time

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pyxllm.cli.main import parse_args
from pyxllm.entrypoints.openai.api_server import exposure_warning
from pyxllm.entrypoints.openai.middleware.security import install_security
from pyxllm.entrypoints.openai.server_options import ServerOptions
from tests.utils import RemoteServer

ENGINE = ["--max-model-len", "512", "--kv-cache-memory", "0.25"]
KEYS = ("sk-alpha-1f2e3d", "sk-beta-4c5b6a", "sk-gamma-7d8e9f")
WRONG_KEY = "sk-wrong-0a0b0c"
ORIGIN, OTHER_ORIGIN = "https://a.example", "https://evil.example"
PROTECTED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/debug/stats"),
    ("GET", "/metrics"),  # --protect-metrics
]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sdk(server: RemoteServer, key: str, **kwargs) -> openai.OpenAI:
    """An OpenAI client of ``server`` sending ``key`` (``RemoteServer.openai_client`` sends
    ``EMPTY``)."""
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60, **kwargs)


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    body = response.json()
    assert body == {
        "error": {
            "message": body["error"]["message"],
            "type": "AuthenticationError",
            "param": None,
            "code": 401,
        }
    }
    assert "Authorization: Bearer" in body["error"]["message"]


# --- flags ---------------------------------------------------------------------------------


def test_security_flags_default_to_open_http_without_cors(monkeypatch):
    monkeypatch.delenv("PYXLLM_API_KEY", raising=False)
    args, _ = parse_args(["serve"])
    assert args.api_keys == () and not args.protect_metrics
    assert (args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs) == (
        None,
        None,
        None,
        0,
    )
    assert args.allowed_origins == [] and not args.allow_credentials
    assert args.allowed_methods == ["*"] and args.allowed_headers == ["*"]


def test_api_keys_repeat_split_on_commas_and_win_over_the_env_var(monkeypatch):
    monkeypatch.setenv("PYXLLM_API_KEY", "from-env")
    args, _ = parse_args(["serve", "--api-key", "a, b", "--api_key=c,a"])
    assert args.api_keys == ("a", "b", "c")
    monkeypatch.setenv("PYXLLM_API_KEY", " e1 ,e2,")
    assert parse_args(["serve"])[0].api_keys == ("e1", "e2")


def test_an_empty_api_key_is_an_error_that_echoes_no_key(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", "--api-key", "secret-one,,"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "cannot be empty" in err and "secret-one" not in err


def test_protect_metrics_needs_a_key(capsys, monkeypatch):
    monkeypatch.delenv("PYXLLM_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["serve", "--protect-metrics"])
    assert "--protect-metrics: needs --api-key" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            '["https://a.example", "http://b.example:8080"]',
            ["https://a.example", "http://b.example:8080"],
        ),
        ("https://a.example, https://b.example", ["https://a.example", "https://b.example"]),
        ('["*"]', ["*"]),
    ],
)
def test_cors_lists_take_json_or_commas(text, expected):
    args, _ = parse_args(["serve", "--allowed-origins", text, "--allowed-methods", '["GET"]'])
    assert args.allowed_origins == expected and args.allowed_methods == ["GET"]


def test_a_cors_list_that_is_not_strings_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", "--allowed-headers", '["x", 1]'])
    assert "--allowed-headers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-certfile: cannot read"),
        (["--ssl-keyfile", "/nonexistent/key.pem"], "--ssl-keyfile: cannot read"),
        (["--ssl-ca-certs", "/nonexistent/ca.pem"], "--ssl-ca-certs: cannot read"),
    ],
)
def test_a_missing_tls_file_is_a_usage_error_naming_the_flag(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A test CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@pyxllm.test")
    root = tmp_path_factory.mktemp("pki")
    paths = {
        "ca": root / "ca.pem",
        "cert": root / "server-cert.pem",
        "key": root / "server-key.pem",
        "client": root / "client.pem",
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    paths["cert"].write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(paths["key"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(paths["client"]))
    return {name: str(path) for name, path in paths.items()}


def test_tls_flags_check_the_files_and_default_cert_reqs(pki, capsys):
    tls = ["serve", "--ssl-certfile", pki["cert"], "--ssl-keyfile", pki["key"]]
    assert parse_args(tls)[0].ssl_cert_reqs == ssl.CERT_NONE
    assert parse_args([*tls, "--ssl-ca-certs", pki["ca"]])[0].ssl_cert_reqs == ssl.CERT_REQUIRED
    argv = [*tls, "--ssl-ca-certs", pki["ca"], "--ssl-cert-reqs", "1"]
    assert parse_args(argv)[0].ssl_cert_reqs == ssl.CERT_OPTIONAL
    for bad, needle in [
        (["serve", "--ssl-keyfile", pki["key"]], "--ssl-keyfile: needs --ssl-certfile"),
        ([*tls, "--ssl-cert-reqs", "2"], "--ssl-cert-reqs: needs --ssl-ca-certs"),
        (["serve", "--ssl-certfile", pki["ca"]], "--ssl-certfile: not a PEM certificate"),
        ([*tls, "--ssl-ca-certs", pki["key"]], "--ssl-ca-certs: not PEM CA certificates"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "host, keys, warned",
    [
        ("127.0.0.1", (), False),
        ("::1", (), False),
        ("[::1]", (), False),
        ("localhost", (), False),
        ("0.0.0.0", (), True),
        ("::", (), True),
        ("192.168.1.20", (), True),
        ("myhost.example", (), True),
        ("0.0.0.0", KEYS[:1], False),
    ],
)
def test_a_server_beyond_loopback_without_a_key_is_warned_of(host, keys, warned):
    warning = exposure_warning(host, keys)
    assert (warning is not None) == warned
    if warned:
        assert f"--host {host}" in warning and "--api-key" in warning


def test_server_options_repr_hides_the_keys():
    assert "sk-alpha" not in repr(ServerOptions(api_keys=("sk-alpha",)))


# --- the middleware on a small app ---------------------------------------------------------


def small_app(**options) -> Starlette:
    async def ok(request):
        return PlainTextResponse("ok")

    async def stream(request):
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(
        routes=[
            Route("/health", ok),
            Route("/metrics", ok),
            Route("/v1/stream", stream),
            Route("/tokenize", ok, methods=["POST"]),
        ]
    )
    install_security(app, ServerOptions(**options))
    return app


def test_middleware_streams_checks_every_key_and_the_scheme():
    client = TestClient(small_app(api_keys=KEYS))
    for key in KEYS:
        response = client.get("/v1/stream", headers=bearer(key))
        assert response.status_code == 200 and response.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert client.get("/v1/stream", headers={"Authorization": f"bearer {KEYS[0]}"}).is_success
    for headers in [
        {},
        bearer(WRONG_KEY),
        bearer(KEYS[0] + "x"),
        bearer(KEYS[0][:-1]),
        {"Authorization": KEYS[0]},
        {"Authorization": f"Basic {KEYS[0]}"},
        {"Authorization": "Bearer "},
    ]:
        assert_401(client.get("/v1/stream", headers=headers))
    assert_401(client.post("/tokenize"))
    assert_401(client.get("/nowhere"))
    # Anthropic's header, alone or beside a Bearer token that is not a key
    for key in KEYS:
        assert client.get("/v1/stream", headers={"x-api-key": key}).is_success
    assert client.get("/v1/stream", headers={"x-api-key": KEYS[1], **bearer("EMPTY")}).is_success
    for headers in [{"x-api-key": WRONG_KEY}, {"x-api-key": ""}, {"X-API-KEY": KEYS[0] + "x"}]:
        assert_401(client.get("/v1/stream", headers=headers))
    # on Anthropic's routes, in Anthropic's error shape
    refused = client.post("/v1/messages", headers={"x-api-key": WRONG_KEY})
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["type"] == "authentication_error"
    assert client.get("/health").is_success and client.get("/metrics").is_success
    # no CORS configured: an OPTIONS "preflight" is not let through
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    assert_401(client.options("/tokenize", headers=preflight))


def test_middleware_is_absent_without_keys_or_origins():
    app = small_app()
    assert [m.cls.__name__ for m in app.user_middleware] == []
    response = TestClient(app).get("/v1/stream", headers={"Origin": ORIGIN})
    assert response.is_success and "access-control-allow-origin" not in response.headers


# --- a real server with keys, CORS and --protect-metrics -----------------------------------


@pytest.fixture(scope="module")
def keyed_server():
    args = [
        *ENGINE,
        "--api-key",
        KEYS[0],
        "--api-key",
        ",".join(KEYS[1:]),
        "--protect-metrics",
        "--allowed-origins",
        f'["{ORIGIN}"]',
    ]
    with RemoteServer(args, env={"OMP_NUM_THREADS": "1", "PYXLLM_API_KEY": ""}) as remote:
        yield remote


def test_a_stored_response_belongs_to_the_key_that_created_it(keyed_server):
    """Another key cannot read, continue or delete it (404, as if it did not exist); its own
    key can."""
    url = keyed_server.url_for("v1", "responses")
    body = {"input": "Hi", "max_output_tokens": 2}
    created = httpx.post(url, json=body, headers=bearer(KEYS[0]), timeout=60)
    assert created.status_code == 200, created.text
    response_id = created.json()["id"]
    other = bearer(KEYS[1])
    assert httpx.get(f"{url}/{response_id}", headers=other, timeout=10).status_code == 404
    assert httpx.delete(f"{url}/{response_id}", headers=other, timeout=10).status_code == 404
    follow = {**body, "previous_response_id": response_id}
    refused = httpx.post(url, json=follow, headers=other, timeout=60)
    assert refused.status_code == 404
    assert refused.json()["error"]["param"] == "previous_response_id"
    owner = bearer(KEYS[0])
    assert httpx.post(url, json=follow, headers=owner, timeout=60).status_code == 200
    got = httpx.get(f"{url}/{response_id}", headers=owner, timeout=10)
    assert got.status_code == 200 and got.json()["id"] == response_id
    assert httpx.delete(f"{url}/{response_id}", headers=owner, timeout=10).status_code == 200
    assert httpx.get(f"{url}/{response_id}", headers=owner, timeout=10).status_code == 404


def test_the_right_key_chats_with_the_openai_sdk(keyed_server):
    client = sdk(keyed_server, KEYS[0])
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
    )
    assert chat.usage.completion_tokens <= 2
    stream = client.completions.create(
        model=chat.model, prompt="The sky is", max_tokens=2, stream=True
    )
    assert len([chunk for chunk in stream]) >= 1


def test_every_key_works_and_a_wrong_one_raises_authentication_error(keyed_server):
    for key in KEYS:
        assert sdk(keyed_server, key).models.list().data
    with pytest.raises(openai.AuthenticationError) as exc:
        sdk(keyed_server, WRONG_KEY).models.list()
    assert exc.value.status_code == 401


def test_protected_routes_answer_401_without_a_key(keyed_server):
    for method, path in PROTECTED:
        for headers in ({}, bearer(WRONG_KEY)):
            response = httpx.request(method, keyed_server.url_for(path), headers=headers, json={})
            assert_401(response)
    tokens = httpx.post(
        keyed_server.url_for("tokenize"), headers=bearer(KEYS[1]), json={"prompt": "Hello"}
    )
    assert tokens.status_code == 200 and tokens.json()["count"] >= 1
    stats = httpx.get(keyed_server.url_for("debug/stats"), headers=bearer(KEYS[2]))
    assert stats.status_code == 200 and "num_running" in stats.json()
    metrics = httpx.get(keyed_server.url_for("metrics"), headers=bearer(KEYS[0]))
    assert metrics.status_code == 200 and "vllm:" in metrics.text


def test_health_and_version_stay_open(keyed_server):
    assert httpx.get(keyed_server.url_for("health")).status_code == 200
    assert httpx.get(keyed_server.url_for("version")).status_code == 200


def test_cors_preflight_allows_only_the_allowed_origin(keyed_server):
    url = keyed_server.url_for("v1", "chat", "completions")
    headers = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    allowed = httpx.options(url, headers={**headers, "Origin": ORIGIN})
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    other = httpx.options(url, headers={**headers, "Origin": OTHER_ORIGIN})
    assert "access-control-allow-origin" not in other.headers
    # a 401 carries the CORS header, so a browser page can read why
    denied = httpx.get(keyed_server.url_for("v1", "models"), headers={"Origin": ORIGIN})
    assert_401(denied)
    assert denied.headers["access-control-allow-origin"] == ORIGIN


def test_no_key_reaches_the_server_log(keyed_server):
    httpx.get(keyed_server.url_for("v1", "models"), headers=bearer(WRONG_KEY))
    time.sleep(0.2)
    log = keyed_server.output()
    assert "an API key is required" in log and "http://" in log
    for key in (*KEYS, WRONG_KEY):
        assert key not in log


# --- a real server over HTTPS, with client certificates and keys from the environment --------


class TLSServer(RemoteServer):
    """A :class:`RemoteServer` over HTTPS: ``ssl_context`` trusts the test CA and presents the
    client certificate."""

    def __init__(self, args, ssl_context: ssl.SSLContext, **kwargs):
        super().__init__(args, **kwargs)
        self.ssl_context = ssl_context

    @property
    def base_url(self) -> str:
        return f"https://{self.host}:{self.port}/v1"

    def url_for(self, *parts: str) -> str:
        return super().url_for(*parts).replace("http://", "https://", 1)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(self.url_for("health"), verify=self.ssl_context).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"HTTPS server not healthy:\n{self.output()[-8000:]}")


def client_context(pki, with_client_cert: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki["ca"])
    if with_client_cert:
        context.load_cert_chain(pki["client"])
    return context


@pytest.fixture(scope="module")
def tls_server(pki):
    args = [
        *ENGINE,
        "--ssl-keyfile",
        pki["key"],
        "--ssl-certfile",
        pki["cert"],
        "--ssl-ca-certs",
        pki["ca"],
    ]
    env = {"OMP_NUM_THREADS": "1", "PYXLLM_API_KEY": "sk-env-one,sk-env-two"}
    with TLSServer(args, client_context(pki), env=env) as remote:
        yield remote


def test_https_with_the_test_ca_and_env_keys(tls_server):
    for key in ("sk-env-one", "sk-env-two"):
        with httpx.Client(verify=tls_server.ssl_context) as http:
            client = sdk(tls_server, key, http_client=http)
            assert client.models.list().data
    with httpx.Client(verify=tls_server.ssl_context) as http:
        with pytest.raises(openai.AuthenticationError):
            sdk(tls_server, KEYS[0], http_client=http).models.list()
    log = tls_server.output()
    assert f"https://127.0.0.1:{tls_server.port}/v1" in log and "sk-env" not in log


def test_https_refuses_untrusted_servers_and_clients_without_a_certificate(tls_server, pki):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(tls_server.url_for("health"))  # the test CA is not trusted
    with pytest.raises(httpx.TransportError):  # no client certificate: the handshake fails
        httpx.get(tls_server.url_for("health"), verify=client_context(pki, False))
    with pytest.raises(httpx.TransportError):  # plain HTTP on the HTTPS port
        httpx.get(tls_server.url_for("health").replace("https://", "http://"))


def test_metrics_open_and_no_cors_without_the_flags(tls_server):
    metrics = httpx.get(tls_server.url_for("metrics"), verify=tls_server.ssl_context)
    assert metrics.status_code == 200
    preflight = httpx.options(
        tls_server.url_for("v1", "models"),
        verify=tls_server.ssl_context,
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    assert_401(preflight)  # no CORS: an OPTIONS request needs the key like any other

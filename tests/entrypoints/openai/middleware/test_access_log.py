"""The per-request access log (``pyxllm.entrypoints.openai.middleware.access_log``) on the app
itself: answers of the outer middleware are logged, ``--disable-uvicorn-access-log`` logs none."""

from __future__ import annotations

import logging

from tests.utils import stub_app_client

KEY = "sk-access-log-5f1e"


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pyxllm.access"]


def test_a_refused_key_and_an_unknown_path_are_logged_with_status_and_duration(caplog):
    client = stub_app_client(api_keys=(KEY,))
    with caplog.at_level(logging.INFO, logger="pyxllm.access"):
        assert client.get("/v1/models").status_code == 401
        assert (
            client.get("/nope?x=1", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
        )
    refused, unknown = access_lines(caplog)
    assert '"GET /v1/models HTTP/1.1" 401 ' in refused and refused.endswith(" ms")
    assert '"GET /nope?x=1 HTTP/1.1" 404 ' in unknown
    assert KEY not in refused + unknown


def test_the_access_log_can_be_turned_off(caplog):
    client = stub_app_client(access_log=False)
    with caplog.at_level(logging.INFO, logger="pyxllm.access"):
        assert client.get("/nope").status_code == 404
    assert access_lines(caplog) == []

"""``https://`` workers: verified against ``proxy.ca_file`` (a private CA), refused otherwise.

The worker is a real uvicorn server speaking TLS on 127.0.0.1 with a certificate made here by
the ``openssl`` command (its own CA, for ``IP:127.0.0.1``: the ``cert`` fixture of conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest
from router_fakeworker import wait_for


async def test_https_worker_with_its_ca_is_proxied_and_checked(workers, router, http, cert):
    a = await workers("a", tls=cert)
    assert a.url.startswith("https://")
    r = await router([a], proxy={"ca_file": cert[0]})
    resp = await http.post(
        r.url + "/v1/completions", json={"model": "fake-model", "prompt": "over tls"}
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvrouter-worker"] == "a" and a.requests[-1]["prompt"] == "over tls"
    assert r.state.registry.workers["a"].healthy  # the health checks speak TLS too


async def test_https_worker_with_an_unknown_ca_is_never_sent_a_request(workers, router, http, cert):
    a = await workers("a", tls=cert)
    r = await router([a], ready=False)  # the system's CAs only: the worker's is not among them
    await wait_for(lambda: not r.state.registry.workers["a"].healthy, 20, "a marked unhealthy")
    assert "certificate" in (r.state.registry.workers["a"].last_error or "").lower()
    resp = await http.post(r.url + "/v1/completions", json={"model": "fake-model", "prompt": "x"})
    assert resp.status_code == 503 and not a.requests


def test_ca_file_must_exist(tmp_path: Path) -> None:
    from router.errors import ConfigError
    from router.settings import load_settings

    with pytest.raises(ConfigError, match="ca_file"):
        load_settings(environ={}, overrides={"proxy": {"ca_file": str(tmp_path / "none.pem")}})

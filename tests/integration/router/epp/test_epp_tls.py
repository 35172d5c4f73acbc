"""The endpoint picker's transport: TLS by default with a self-signed certificate made at each
start (as the Gateway API Inference Extension's picker does), a certificate from files (see
``test_epp_server.test_tls_round_trip``), and plaintext only when ``epp.plaintext`` says so, with
a warning. Real router, real gRPC clients over real sockets."""

from __future__ import annotations

import ipaddress
import json
import logging

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from epp_envoy import Envoy, served_certificate
from router_fakeworker import wait_for

from router.edge.epp.messages import endpoint_of
from router.errors import ConfigError
from router.settings import load_settings

BODY = json.dumps({"model": "fake-model", "prompt": "over the wire"}).encode()


async def _picks(envoy: Envoy, worker_url: str) -> None:
    p = await envoy.pick("/v1/completions", BODY)
    assert p.immediate is None and p.endpoint == endpoint_of(worker_url) and p.body == BODY
    p.call.cancel()


async def test_the_default_is_tls_with_a_self_signed_certificate_made_at_start(
    workers, epp, caplog
):
    caplog.set_level(logging.INFO, logger="kvrouter.epp")
    a = await workers("a")
    r, envoy = await epp([a])  # no epp.tls_cert, no epp.plaintext
    # the fixture's client trusts the certificate served, and checks it names 127.0.0.1
    await _picks(envoy, a.url)
    port = r.app.state.epp_port
    pem = await served_certificate(port)
    cert = x509.load_pem_x509_certificate(pem)
    assert cert.issuer == cert.subject  # self-signed
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    lines = [x.getMessage() for x in caplog.records if x.name == "kvrouter.epp"]
    assert any(m.endswith(f":{port} (tls, self-signed)") for m in lines), lines
    assert not [x for x in caplog.records if x.levelno >= logging.WARNING]
    plain = Envoy(port)  # a plaintext client gets nothing from it
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await plain.health("liveness")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await plain.aclose()
    # another start, another key: nothing is kept or shared between pickers
    r2, _ = await epp([a])
    assert await served_certificate(r2.app.state.epp_port) != pem
    await wait_for(lambda: r.state.placer.inflight == 0, 10)


async def test_plaintext_only_when_set_and_then_with_a_warning(workers, epp, caplog):
    caplog.set_level(logging.INFO, logger="kvrouter.epp")
    a = await workers("a")
    r, envoy = await epp([a], epp={"plaintext": True})
    await _picks(envoy, a.url)
    warnings = [
        x.getMessage()
        for x in caplog.records
        if x.name == "kvrouter.epp" and x.levelno == logging.WARNING
    ]
    assert len(warnings) == 1 and "epp.plaintext: true" in warnings[0], warnings
    port = r.app.state.epp_port
    assert any(x.getMessage().endswith(f":{port} (plaintext)") for x in caplog.records)
    tls = Envoy(port, creds=grpc.ssl_channel_credentials())  # a TLS client finds no TLS
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await tls.health("liveness")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await tls.aclose()
    await wait_for(lambda: r.state.placer.inflight == 0, 10)


def test_plaintext_and_a_certificate_together_are_a_config_error(cert):
    crt, key = cert
    epp = {"port": 0, "plaintext": True, "tls_cert": crt, "tls_key": key}
    with pytest.raises(ConfigError, match=r"epp\.plaintext: contradicts"):
        load_settings(environ={}, overrides={"epp": epp})

"""The picker's transport security (:func:`server_credentials`): TLS by default, as the Gateway
API Inference Extension's own picker serves it (its ``--secure-serving``, on by default).

- ``epp.tls_cert`` / ``epp.tls_key``: that certificate (PEM files);
- neither: a self-signed certificate made in memory at each start (ECDSA P-256, for the host
  the picker binds and ``localhost``), as GIE's picker does without ``--cert-path``. It encrypts
  the hop; it proves nothing about the picker, so a client that wants that configures a CA and
  a certificate from it. Envoy's cluster to the picker does not verify it (deploy/gateway);
- ``epp.plaintext: true``: no TLS, for a trusted network only (a pod-local sidecar, a mesh that
  encrypts itself); the start logs a warning saying so.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging

import grpc

from router.errors import ConfigError
from router.settings.epp import EppSettings

__all__ = ["self_signed", "server_credentials"]

log = logging.getLogger("kvrouter.epp")

#: the generated certificate's life: the process's, with room (GIE's lasts ten years too)
_VALID = datetime.timedelta(days=3650)


def server_credentials(s: EppSettings) -> tuple[grpc.ServerCredentials | None, str]:
    """(the credentials, None for plaintext; what the start line says of them)."""
    if s.plaintext:
        log.warning(
            "EPP serving plaintext gRPC (epp.plaintext: true): anyone on the network of %s can "
            "read and steer every request through it; only on a trusted network",
            s.host,
        )
        return None, "plaintext"
    if s.tls_cert is not None and s.tls_key is not None:
        with open(s.tls_key, "rb") as k, open(s.tls_cert, "rb") as c:
            key, cert = k.read(), c.read()
        return grpc.ssl_server_credentials([(key, cert)]), "tls"
    key, cert = self_signed(s.host)
    return grpc.ssl_server_credentials([(key, cert)]), "tls, self-signed"


def self_signed(host: str) -> tuple[bytes, bytes]:
    """A new key and a self-signed certificate for ``host`` and ``localhost`` (PEM)."""
    try:  # (imported here: only a start without certificate files needs it)
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:
        raise ConfigError(
            "epp: TLS without epp.tls_cert/epp.tls_key makes a self-signed certificate, which "
            f"needs the epp extra (pip install 'kvrouter[epp]'): {e}"
        ) from e

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrouter-epp")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))  # (a peer's clock a little behind)
        .not_valid_after(now + _VALID)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)

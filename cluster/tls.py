"""TLS from certificate files in the config, and development certificates.

- The router's public port serves TLS when `auth.tls_cert` / `auth.tls_key` are set.
- With `auth.tls_ca` as well, internal channels are mutual TLS: workers accept only clients with a
  certificate signed by that CA, and every Tandem process presents `tls_cert` when it calls a
  worker (and trusts `tls_ca` when it calls anyone).
- `tandem certs --out DIR` writes a development CA and one certificate (for 127.0.0.1 and
  localhost, usable as server and client) signed by it. Not for production.

The collective transport's tensor traffic (torch.distributed) is not encrypted: keep it on a
trusted network or use the `grpc` transport.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc

from cluster.config import AuthConfig


def _read(path: Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def server_credentials(auth: AuthConfig, internal: bool) -> grpc.ServerCredentials | None:
    """None serves plaintext. `internal` servers require client certificates when a CA is set."""
    if auth.tls_cert is None:
        return None
    ca = _read(auth.tls_ca) if internal else None
    pair = [(_read(auth.tls_key), _read(auth.tls_cert))]
    return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(auth: AuthConfig) -> grpc.ChannelCredentials | None:
    """What a Tandem process presents and trusts when it calls another (None: plaintext)."""
    if auth.tls_ca is None and auth.tls_cert is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(auth.tls_ca), private_key=_read(auth.tls_key), certificate_chain=_read(auth.tls_cert)
    )


def channel(target: str, credentials: grpc.ChannelCredentials | None, options=()) -> grpc.Channel:  # type: ignore[no-untyped-def]
    if credentials is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, credentials, options=list(options))


def generate_dev_certs(out: str | Path, days: int = 30) -> dict[str, Path]:
    """Writes ca.pem, cert.pem and key.pem (127.0.0.1 / localhost, server and client use) to `out`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tandem development CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": out / "ca.pem", "cert": out / "cert.pem", "key": out / "key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths["key"].chmod(0o600)
    return paths

"""TLS for a run's bus: a local certificate authority and the certificates it signs.

`make_local_pki(folder)` writes, under `folder` (keys mode 0600):

* `ca.pem`, `ca-key.pem`: a fresh CA (ECDSA P-256), valid for `VALIDITY_DAYS`;
* `server.pem`, `server-key.pem`: the servers' certificate, for 127.0.0.1 and localhost (and
  any further host names given), good for serving clients and for the routes between the
  servers of a cluster (server and client use);
* `client.pem`, `client-key.pem`: one client certificate for the run's actors (mutual TLS).

The embedded server (`ops.natsserver`, `[bus] tls = "local"`) and `python -m ops.cluster
--tls` use it; an operator with a CA of their own sets `[bus] tls = "on"` and the files
instead (docs/deploy.md). `ServerTls.block()` is the nats-server config's `tls {}` block.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from actors.base.connection import TlsFiles

VALIDITY_DAYS = 30  # a run's certificates: long enough for any run, short enough to be disposable
HANDSHAKE_TIMEOUT_S = 5  # nats-server's TLS handshake timeout (its default, 2 s, is tight on loaded hosts)
LOCAL_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A server's certificate and key, and the CA it checks client certificates against."""

    cert: str
    key: str
    ca: str
    verify_clients: bool = True  # mutual TLS: a client without a certificate the CA signed is refused

    def block(self) -> str:
        """The `tls {}` block of a nats-server config (clients' port, or a cluster's routes)."""
        return (
            "tls {\n"
            f'  cert_file: "{self.cert}"\n'
            f'  key_file: "{self.key}"\n'
            f'  ca_file: "{self.ca}"\n'
            f"  verify: {'true' if self.verify_clients else 'false'}\n"
            f"  timeout: {HANDSHAKE_TIMEOUT_S}\n"
            "}\n"
        )


@dataclass(frozen=True, slots=True)
class LocalPki:
    server: ServerTls
    client: TlsFiles


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Prorsa run"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(path, 0o600)
    return str(path.resolve())


def _write_cert(path: Path, cert: x509.Certificate) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path.resolve())


def _san(hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _sign(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, **kinds
) -> x509.Certificate:
    """A certificate for `key`: a CA (issuer None: self-signed) or, signed by `issuer`, a leaf
    with the extended key usages in `kinds` (`server`, `client`) and `hosts`' names."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer[0].subject if issuer else _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)  # cert and CRL signing
        builder = builder.add_extension(usage, critical=True)
        return builder.sign(key, hashes.SHA256())
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] * bool(kinds.get("server")) + [ExtendedKeyUsageOID.CLIENT_AUTH] * bool(kinds.get("client"))
    builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if kinds.get("hosts"):
        builder = builder.add_extension(_san(tuple(kinds["hosts"])), critical=False)
    return builder.sign(issuer[1], hashes.SHA256())


def make_local_pki(folder: Path, hosts: tuple[str, ...] = LOCAL_HOSTS, verify_clients: bool = True) -> LocalPki:
    """A fresh CA under `folder`, the servers' certificate for `hosts`, and one client
    certificate (module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = _sign("Prorsa run CA", ca_key, None)
    server = _sign("nats-server", server_key, (ca, ca_key), server=True, client=True, hosts=hosts)
    client = _sign("prorsa-actor", client_key, (ca, ca_key), client=True)
    ca_path = _write_cert(folder / "ca.pem", ca)
    _write_key(folder / "ca-key.pem", ca_key)
    server_tls = ServerTls(
        _write_cert(folder / "server.pem", server), _write_key(folder / "server-key.pem", server_key), ca_path, verify_clients
    )
    client_files = TlsFiles(ca_path, _write_cert(folder / "client.pem", client), _write_key(folder / "client-key.pem", client_key))
    return LocalPki(server_tls, client_files)

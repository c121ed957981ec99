"""A development CA and a certificate for every part of a deployment (`kvferry certs`).

For trying the secure mode on one machine or in a test cluster: one command writes a CA,
a server+client certificate per part, and a policy file naming them. Production CAs are
the operator's (cert-manager, see deploy/kubernetes); nothing here is needed at run time.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvferry.security.policy import digest

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 365
_Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Issued:
    """What `make_dev_ca` wrote: the directory, the identities, and the admin's token."""

    out: Path
    identities: tuple[str, ...]
    admin_token: str
    """A bearer token for the `admin-token` identity (for grpcurl), kept only in admin.token."""


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvferry dev"),
        ]
    )


def _san(hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _write(out: Path, name: str, key: _Key, cert: x509.Certificate) -> None:
    (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = out / f"{name}.key"
    key_path.touch(mode=0o600)
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def _certificate(
    cn: str, key: _Key, issuer: x509.Name, signer: _Key, hosts: tuple[str, ...], ca: bool = False
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True)
    else:
        purposes = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if hosts else [])
        builder = builder.add_extension(x509.ExtendedKeyUsage(purposes), critical=False)
        if hosts:
            builder = builder.add_extension(_san(hosts), critical=False)
    return builder.sign(signer, hashes.SHA256())


def identities_of(nodes: tuple[str, ...]) -> dict[str, str]:
    """Identity name -> the policy entry's body, for a deployment with engines `nodes`."""
    parts = {
        "daemon": 'role = "daemon"',
        "router": 'role = "router"\ntenants = ["*"]',
        "admin": 'role = "admin"',
        "reader": 'role = "reader"\ntenants = ["*"]',
        "etcd": "",
    }
    for node in nodes:
        parts[f"sidecar-{node}"] = f'role = "sidecar"\nnode = "{node}"'
    return parts


TOKEN_PREFIX = "kvft_"
"""What every bearer token `kvferry certs` makes starts with: a secret scanner can tell it,
and it never starts with "-" (a bare token_urlsafe does, 1 time in 64, and then
``--token TOKEN`` reads as a flag: argparse refused it, a CI run failed on it)."""


def new_token() -> str:
    """A bearer token: TOKEN_PREFIX and 256 random bits, URL-safe."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def make_dev_ca(out: Path, hosts: tuple[str, ...] = (), nodes: tuple[str, ...] = ()) -> Issued:
    """Write ca.pem/ca.key, NAME.pem/NAME.key per identity, admin.token and policy.toml into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("kvferry development CA")
    _write(out, "ca", ca_key, _certificate("kvferry development CA", ca_key, ca_name, ca_key, (), ca=True))
    server_hosts = tuple(dict.fromkeys(LOCAL_HOSTS + hosts))
    parts = identities_of(nodes)
    for name in parts:
        key = ec.generate_private_key(ec.SECP256R1())
        serves = name in ("daemon", "etcd", "router") or name.startswith("sidecar-")
        _write(out, name, key, _certificate(name, key, ca_name, ca_key, server_hosts if serves else ()))
    token = new_token()
    token_path = out / "admin.token"
    token_path.touch(mode=0o600)
    token_path.write_text(token + "\n")
    entries = [f"[identities.{n}]\n{body}\n" for n, body in parts.items() if body]
    entries.append(f'[identities.admin-token]\nrole = "admin"\ntoken_sha256 = "{digest(token)}"\n')
    (out / "policy.toml").write_text(
        "# Written by `kvferry certs`: who is who in a development deployment.\n\n" + "\n".join(entries)
    )
    return Issued(out, tuple(parts), token)

"""The cluster's certificate authority: one CA, one certificate per identity.

An identity is a name and a role. The name is the certificate's common name (a node's
`--name`, `master`, or an operator's name); the role is its organizational unit:

- `master`: serves the metadata RPC.
- `node`: registers, reports, heartbeats and serves chunks, as itself only.
- `admin`: a status client that may also change the cluster (remove a node).
- `client`: a read-only status client.

A node's certificate also lists the IP addresses it may advertise (subject alternative
names): the master refuses a registration whose peer address is not among them.

Keys are ECDSA P-256 (every TLS 1.3 stack has it; signing is cheap for the handshake rate a
cluster sees). Files are written with mode 0600 for keys, 0644 for certificates.
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

from kvfs.errors import ConfigError
from kvfs.security.keyfiles import check_private_file

ROLES = ("master", "node", "admin", "client")
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
IDENTITY_CERT = "identity.crt"
IDENTITY_KEY = "identity.key"
CA_YEARS = 10
IDENTITY_DAYS = 825  # the longest validity common TLS stacks accept for a leaf certificate
MAX_NAME_BYTES = 255  # a node's name travels in the protocol's name fields


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def check_name(name: str) -> None:
    if not name or len(name.encode()) > MAX_NAME_BYTES:
        raise ConfigError(f"identity name {name!r}: must be 1-{MAX_NAME_BYTES} bytes")
    if any(ch in name for ch in "\x00\n\r/") or not name.isprintable():
        raise ConfigError(f"identity name {name!r}: no '/', control characters or NUL")


def _write(path: Path, data: bytes, mode: int, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise ConfigError(f"{path}: exists (remove it first, or pass --force)")
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".new")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not widen or narrow it
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def init_ca(directory: Path, name: str = "kvfs cluster CA", overwrite: bool = False) -> Issued:
    """Creates the CA's key and self-signed certificate in `directory`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvfs"),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365 * CA_YEARS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    issued = Issued(directory / CA_CERT, directory / CA_KEY)
    _write(issued.key, _key_pem(key), 0o600, overwrite)
    _write(issued.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644, overwrite)
    return issued


def load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    for path in (cert_path, key_path):
        if not path.exists():
            raise ConfigError(f"{path}: no such file (create the CA with `kvfs ca init --dir {directory}`)")
    check_private_file(key_path)
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{key_path}: not an EC private key")
    return cert, key


def issue(ca_directory: Path, name: str, role: str, out_directory: Path,
          addresses: list[str] = [], overwrite: bool = False) -> Issued:
    """Writes an identity's bundle into `out_directory`: identity.crt and identity.key for NAME in
    `role`, and a copy of the CA's certificate (ca.crt), so the directory is all a process needs
    (`--tls-dir`)."""
    if role not in ROLES:
        raise ConfigError(f"role {role!r}: one of {', '.join(ROLES)}")
    check_name(name)
    ips = []
    for address in addresses:
        try:
            ips.append(ipaddress.ip_address(address))
        except ValueError:
            raise ConfigError(f"address {address!r}: not an IP address") from None
    ca_cert, ca_key = load_ca(ca_directory)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvfs"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder()
               .subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(min(now + datetime.timedelta(days=IDENTITY_DAYS), ca_cert.not_valid_after_utc))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if ips:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ip) for ip in ips]),
                                        critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    issued = Issued(out_directory / IDENTITY_CERT, out_directory / IDENTITY_KEY)
    _write(issued.key, _key_pem(key), 0o600, overwrite)
    _write(issued.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644, overwrite)
    if (out_directory / CA_CERT).resolve() != (ca_directory / CA_CERT).resolve():
        _write(out_directory / CA_CERT, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644, True)
    return issued

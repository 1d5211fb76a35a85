"""A process's credentials (its identity bundle) and the TLS contexts built from them.

A bundle is a directory (`--tls-dir`, default /etc/kvfs/tls) written by `kvfs ca issue`:
`ca.crt` (the cluster's CA, the only one trusted), `identity.crt` and `identity.key`.
Every connection is TLS 1.3 with certificates on both sides; the peer's identity (name and
role) is read from its certificate and checked by the code that serves it, never taken from
what the peer says about itself.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfs.errors import ConfigError
from kvfs.security.ca import CA_CERT, IDENTITY_CERT, IDENTITY_KEY, ROLES
from kvfs.security.keyfiles import check_private_file

DEFAULT_TLS_DIR = "/etc/kvfs/tls"


@dataclass(frozen=True)
class Identity:
    """Who is at the other end of a connection, as its certificate says."""

    name: str
    role: str
    addresses: tuple[str, ...] = ()  # IP addresses the certificate allows (nodes)

    def __str__(self) -> str:
        return f"{self.role} {self.name!r}"


@dataclass(frozen=True)
class Credentials:
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_directory(cls, directory: str | Path, role: str = "ROLE") -> Credentials:
        """The bundle in DIRECTORY; ROLE only shapes the hint of the error for a missing file."""
        root = Path(directory)
        creds = cls(root / CA_CERT, root / IDENTITY_CERT, root / IDENTITY_KEY)
        for path in (creds.ca, creds.cert, creds.key):
            if not path.exists():
                address = " --address IP" if role == "node" else ""
                raise ConfigError(f"{path}: no such file (issue this process's credentials with "
                                  f"`kvfs ca issue NAME --role {role}{address} --out {root}` and copy them here, "
                                  f"or point --tls-dir at them)")
        check_private_file(creds.key)
        return creds

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(purpose, cafile=str(self.ca))
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(f"{self.ca}: cannot load the CA certificate ({error})") from None
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False  # identities are names and roles, checked by the caller
        context.verify_mode = ssl.CERT_REQUIRED  # both sides show a certificate of this CA
        try:
            context.load_cert_chain(str(self.cert), str(self.key))
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(f"{self.cert}, {self.key}: cannot load ({error})") from None
        return context

    def server_context(self) -> ssl.SSLContext:
        context = self._context(ssl.Purpose.CLIENT_AUTH)
        context.num_tickets = 0  # no resumption: connections are few and long-lived, and tickets are state
        return context

    def client_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.SERVER_AUTH)

    def identity(self) -> Identity:
        """This process's own identity, read from its certificate."""
        from cryptography import x509

        return identity_of_certificate(x509.load_pem_x509_certificate(self.cert.read_bytes()))


def identity_of_certificate(cert: Any) -> Identity:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    def one(oid: Any) -> str:
        values = cert.subject.get_attributes_for_oid(oid)
        return str(values[0].value) if len(values) == 1 else ""

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        addresses = tuple(str(ip) for ip in san.get_values_for_type(x509.IPAddress))
    except x509.ExtensionNotFound:
        addresses = ()
    return _checked(one(NameOID.COMMON_NAME), one(NameOID.ORGANIZATIONAL_UNIT_NAME), addresses)


def identity_of_peer(peer_cert: dict[str, Any] | None) -> Identity:
    """The identity in a verified peer certificate as `SSLObject.getpeercert()` returns it."""
    if not peer_cert:
        raise ssl.SSLError("the peer showed no certificate")
    fields: dict[str, list[str]] = {}
    for rdn in peer_cert.get("subject", ()):
        for key, value in rdn:
            fields.setdefault(key, []).append(value)
    addresses = tuple(value for kind, value in peer_cert.get("subjectAltName", ()) if kind == "IP Address")
    name = fields.get("commonName", [""])
    role = fields.get("organizationalUnitName", [""])
    return _checked(name[0] if len(name) == 1 else "", role[0] if len(role) == 1 else "", addresses)


def _checked(name: str, role: str, addresses: tuple[str, ...]) -> Identity:
    if not name or role not in ROLES:
        raise ssl.SSLError(f"the certificate names no kvfs identity (name {name[:64]!r}, role {role[:16]!r})")
    return Identity(name, role, addresses)


@dataclass(frozen=True)
class Tls:
    """What a process needs for its cluster connections: its identity and both TLS contexts
    (built once from its bundle)."""

    identity: Identity
    client: ssl.SSLContext
    server: ssl.SSLContext
    directory: Path

    @classmethod
    def load(cls, directory: str | Path, role: str = "ROLE") -> Tls:
        """The bundle in DIRECTORY; a ConfigError names the file and the command that makes it."""
        credentials = Credentials.from_directory(directory, role)
        try:
            identity = credentials.identity()
        except (ValueError, ssl.SSLError) as error:
            raise ConfigError(f"{credentials.cert}: not a kvfs identity certificate ({error})") from None
        return cls(identity, credentials.client_context(), credentials.server_context(), Path(directory))

    def require_role(self, *roles: str) -> None:
        """Refuses a bundle of another role (a client's bundle given to a node, say)."""
        if self.identity.role not in roles:
            raise ConfigError(f"{self.directory}: the certificate is {self.identity}, this needs role "
                              f"{' or '.join(roles)} (`kvfs ca issue NAME --role {roles[0]} --out {self.directory}`)")

"""A private CA for the handoff link: `muser certs init DIR`, `muser certs issue DIR NAME`,
and the TLS 1.3 mutual-authentication contexts both roles build from it (book 10.7).

DIR holds, all written atomically (temp file, fsync, rename; keys mode 0600):

    ca.crt, ca.key     the CA (EC P-256, self-signed, path length 0)
    NAME.crt, NAME.key one leaf per peer (CN and DNS SAN = NAME, server + client auth)
    hmac.key           32 random bytes: the manifest sealing key (muser.handoff.manifest)
    peers.json         {NAME: SHA-256 fingerprint of NAME.crt's DER}: the allow list

A peer is admitted only if its chain ends at ca.crt (checked by OpenSSL in the handshake) AND
its certificate's name is allowed AND that name's fingerprint in peers.json equals the
presented certificate's: removing a name from peers.json revokes it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import secrets
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from ..errors import HandoffRefused, MuserError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{0,62}$")
HMAC_KEY_BYTES = 32
CA_DAYS = 3650
LEAF_DAYS = 825


def _write(path: Path, data: bytes, private: bool) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or name == "ca":
        raise MuserError(f"peer name {name!r} must match {NAME_RE.pattern} and not be 'ca'")
    return name


def fingerprint(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def init(directory: str | os.PathLike) -> Path:
    """Create a new CA and sealing key in DIR (refuses a DIR that already holds one)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = Path(directory)
    for f in ("ca.crt", "ca.key", "hmac.key"):
        if (d / f).exists():
            raise MuserError(f"{d / f} already exists: refusing to replace a CA")
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"muser handoff CA {secrets.token_hex(4)}")])
    now = _dt.datetime.now(_dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         key_cert_sign=True, crl_sign=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(d / "ca.key", _key_pem(key), private=True)
    _write(d / "hmac.key", secrets.token_bytes(HMAC_KEY_BYTES), private=True)
    _write(d / "peers.json", b"{}\n", private=False)
    _write(d / "ca.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)
    return d


def issue(directory: str | os.PathLike, name: str) -> Path:
    """Issue NAME.crt/NAME.key from DIR's CA and allow NAME's fingerprint in peers.json."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(directory)
    check_name(name)
    try:
        ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
        ca = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    except FileNotFoundError as e:
        raise MuserError(f"{e.filename} is missing: run `muser certs init {d}` first") from None
    if (d / f"{name}.crt").exists() or (d / f"{name}.key").exists():
        raise MuserError(f"{d / (name + '.crt')} already exists: peer {name!r} was issued before")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _dt.datetime.now(_dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    der = cert.public_bytes(serialization.Encoding.DER)
    peers = load_peers(d)
    peers[name] = fingerprint(der)
    _write(d / f"{name}.key", _key_pem(key), private=True)
    _write(d / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(d / "peers.json", (json.dumps(peers, indent=2, sort_keys=True) + "\n").encode(), private=False)
    return d / f"{name}.crt"


def load_peers(directory: Path) -> dict[str, str]:
    p = Path(directory) / "peers.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise MuserError(f"{p} is missing: run `muser certs init {directory}` first") from None
    except ValueError as e:
        raise MuserError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for k, v in data.items()):
        raise MuserError(f"{p} must map peer names to SHA-256 hex fingerprints")
    return data


@dataclass(frozen=True)
class Certs:
    """One role's view of a certs DIR: its own leaf (or none), the CA, the sealing key, the
    allow list."""

    directory: Path
    name: str | None  # this role's certificate (None: present no certificate)
    hmac_key: bytes
    peers: dict[str, str]

    @classmethod
    def load(cls, directory: str | os.PathLike, name: str | None) -> Certs:
        d = Path(directory)
        if not (d / "ca.crt").is_file():
            raise MuserError(f"{d / 'ca.crt'} is missing: run `muser certs init {d}` first")
        if name is not None:
            check_name(name)
            for f in (f"{name}.crt", f"{name}.key"):
                if not (d / f).is_file():
                    raise MuserError(f"{d / f} is missing: run `muser certs issue {d} {name}`")
        try:
            key = (d / "hmac.key").read_bytes()
        except FileNotFoundError:
            raise MuserError(f"{d / 'hmac.key'} is missing: the certs dir was not made by `muser certs init`") \
                from None
        if len(key) != HMAC_KEY_BYTES:
            raise MuserError(f"{d / 'hmac.key'} holds {len(key)} bytes, expected {HMAC_KEY_BYTES}")
        return cls(d, name, key, load_peers(d))

    def _context(self, purpose: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose == 0 else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.check_hostname = False  # peers are checked by name + fingerprint below, not by address
        ctx.load_verify_locations(cafile=str(self.directory / "ca.crt"))
        if self.name is not None:
            ctx.load_cert_chain(str(self.directory / f"{self.name}.crt"), str(self.directory / f"{self.name}.key"))
        return ctx

    def server_context(self) -> ssl.SSLContext:
        if self.name is None:
            raise MuserError("a listening role needs its own certificate name")
        return self._context(0)

    def client_context(self) -> ssl.SSLContext:
        return self._context(1)

    def check_peer(self, sock: ssl.SSLSocket, allowed: Iterable[str] | None) -> str:
        """The verified peer's name, if it is allowed by name and its fingerprint is the one on
        record; else HandoffRefused."""
        der = sock.getpeercert(binary_form=True)
        if not der:
            raise HandoffRefused("peer presented no certificate")
        fp = fingerprint(der)
        subject: Any = (sock.getpeercert() or {}).get("subject", ())  # ((("commonName", NAME),), ...)
        names = [v for k in subject for (a, v) in k if a == "commonName"]
        if len(names) != 1:
            raise HandoffRefused(f"peer certificate {fp[:16]} has {len(names)} common names, expected one")
        name = names[0]
        allow = set(self.peers) if allowed is None else set(allowed)
        if name not in allow:
            raise HandoffRefused(f"peer {name!r} (sha256 {fp[:16]}) is not allowed (allowed: {sorted(allow)})")
        if self.peers.get(name) != fp:
            raise HandoffRefused(f"peer {name!r} presented sha256 {fp[:16]}, peers.json records "
                                 f"{(self.peers.get(name) or 'none')[:16]}")
        return name

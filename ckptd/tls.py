"""Mutual TLS for the TCP control plane: the files, and a small cluster CA.

Every TCP listener (coordinator, agent) speaks gRPC over TLS and demands a
client certificate signed by the cluster's CA; every TCP client presents
one. A TLS directory holds three PEM files:

    ca.pem     the CA that signs every certificate of the cluster
    cert.pem   this identity's certificate (CN = its name, OU = its role)
    key.pem    its private key (0600, owned by the user who reads it)

The role is the certificate's organizational unit: `user` (a person or a
service that launches and drives jobs; CN is the user name jobs run as),
`node` (an agent; CN is the node's name), `coordinator`. `ckptd certs`
makes the CA and issues the three kinds; an operator's own PKI works too,
as long as its certificates carry the role in OU (see ARCHITECTURE.md,
Security). A certificate without a known OU is a user's.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ckptd.errors import CkptdError, Code
from ckptd.nofollow import read_private

CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "cert.pem", "key.pem"
CA_KEY_FILE = "ca.key"
ROLES = ("user", "node", "coordinator")


@dataclass(frozen=True)
class TlsFiles:
    """The PEM bytes of one identity, checked once when loaded."""

    directory: Path
    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory: str | Path) -> TlsFiles:
        d = Path(directory)
        found = {}
        for name in (CA_FILE, CERT_FILE, KEY_FILE):
            path = d / name
            try:
                found[name] = read_private(path, "TLS key") if name == KEY_FILE else path.read_bytes()
            except OSError as e:
                raise CkptdError(
                    Code.FAILED_PRECONDITION,
                    f"cannot read {path} ({e.strerror}); a TLS directory holds ca.pem, cert.pem and key.pem "
                    "(`ckptd certs issue` makes one)",
                ) from None
        return cls(d, found[CA_FILE], found[CERT_FILE], found[KEY_FILE])


def default_dir() -> Path | None:
    """Where a process finds its identity: $CKPTD_TLS_DIR, else $CKPTD_HOME/tls
    when that exists (None: no TLS configured)."""
    env = os.environ.get("CKPTD_TLS_DIR")
    if env:
        return Path(env)
    from ckptd.paths import default_home

    d = default_home() / "tls"
    return d if (d / CERT_FILE).exists() else None


# ---- the cluster CA (`ckptd certs`) ----


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise CkptdError(Code.PERMISSION_DENIED, f"{path} is not a directory of uid {os.geteuid()}; use another")
    os.chmod(path, 0o700)


def _name(cn: str, ou: str) -> object:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ckptd"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _pem_key(key: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(  # type: ignore[attr-defined, no-any-return]
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(directory: Path, name: str = "ckptd cluster CA", days: int = 3650) -> Path:
    """ca.pem and ca.key (0600) in directory; refuses to overwrite a CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    _private_dir(directory)
    if (directory / CA_KEY_FILE).exists():
        raise CkptdError(Code.ALREADY_EXISTS, f"{directory} already holds a CA; issue certificates with it")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(name, "ca")
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)  # type: ignore[arg-type]
        .issuer_name(subject)  # type: ignore[arg-type]
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write_private(directory / CA_KEY_FILE, _pem_key(key))
    _write_public(directory / CA_FILE, cert.public_bytes(serialization.Encoding.PEM))
    return directory


def issue(ca_dir: Path, out: Path, name: str, role: str, *, hosts: list[str] | None = None, days: int = 825) -> Path:
    """A TLS directory for one identity, signed by the CA in ca_dir.

    Nodes and the coordinator are servers too: their certificate names the
    hosts clients dial (hosts; default: the name, localhost and 127.0.0.1).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if role not in ROLES:
        raise CkptdError(Code.INVALID_ARGUMENT, f"unknown role {role!r}; use one of: {', '.join(ROLES)}")
    if not name or not name.isprintable() or "/" in name or len(name) > 64:
        raise CkptdError(Code.INVALID_ARGUMENT, f"bad certificate name {name!r}: 1-64 printable characters, no '/'")
    try:
        ca_cert = x509.load_pem_x509_certificate((ca_dir / CA_FILE).read_bytes())
        ca_key = serialization.load_pem_private_key((ca_dir / CA_KEY_FILE).read_bytes(), password=None)
    except (OSError, ValueError) as e:
        raise CkptdError(
            Code.FAILED_PRECONDITION, f"no usable CA in {ca_dir} ({e}); make one with `ckptd certs ca --dir DIR`"
        ) from None
    _private_dir(out)
    if (out / KEY_FILE).exists():
        raise CkptdError(Code.ALREADY_EXISTS, f"{out} already holds a key; issue into a new directory")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name, role))  # type: ignore[arg-type]
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if role != "user":
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        sans: list[x509.GeneralName] = []
        for host in hosts or [name, "localhost", "127.0.0.1"]:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False).sign(
        ca_key,  # type: ignore[arg-type]
        hashes.SHA256(),
    )
    _write_private(out / KEY_FILE, _pem_key(key))
    _write_public(out / CERT_FILE, cert.public_bytes(serialization.Encoding.PEM))
    _write_public(out / CA_FILE, (ca_dir / CA_FILE).read_bytes())
    return out


def subject_of(pem: bytes) -> tuple[str, str]:
    """(common name, role) of a peer's certificate."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(pem)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    role = str(ou[0].value) if ou else "user"
    return (str(cn[0].value) if cn else "", role if role in ROLES else "user")

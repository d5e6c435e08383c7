"""The certificates a single-node launch makes for its job where the user brings none, as Dask's
``Security.temporary()`` does: a CA of the job's own and one certificate it signs, which every shard serves with
and every worker (and the launcher's own reads) shows: mutual TLS.  They are kept in ``RUN/tls/``, each file
readable by its user alone and never written through a link (:func:`psgd.observe.files.open_own`), so that
``psgd launch --resume`` keeps the CA and ``psgd status`` can be pointed at them.  EC keys (P-256), valid for
:data:`DAYS` days; a kept CA that has less than a day left is replaced.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from psgd.errors import InputError
from psgd.observe.files import open_own, read_own
from psgd.wire.tls import TLSFiles

log = logging.getLogger(__name__)

#: the folder of a run that holds the job's CA and certificate
TLS_FOLDER = "tls"
#: its files: the CA's certificate and key, and the certificate it signed for the job's processes and its key
CA, CA_KEY, CERT, KEY = "ca.pem", "ca.key", "job.pem", "job.key"
#: how long a made CA and certificate are valid: long enough for a job and its resumptions, short enough that a
#: copy left behind soon means nothing
DAYS = 30
#: the names every made certificate carries, beside the hosts of the launch: where a single node's shards bind
LOOPBACK = ("127.0.0.1", "localhost")


def job_tls(run: Path, hosts: Iterable[str] = ()) -> TLSFiles:
    """The CA kept in ``run/tls`` (else a new one) and a new certificate it signs for ``127.0.0.1``,
    ``localhost`` and ``hosts`` (names or addresses), written there; the files for the job's processes."""
    folder = run / TLS_FOLDER
    if folder.is_symlink() or folder.exists() and not folder.is_dir():
        raise InputError(
            f"{folder}: not a folder of psgd's own (a link or a file): remove it, or give the run another folder"
        )
    folder.mkdir(mode=0o700, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca = _kept_ca(folder, now)
    if ca is None:
        ca = _new_ca(now)
        _write(folder / CA_KEY, _key_pem(ca[1]))
        _write(folder / CA, ca[0].public_bytes(serialization.Encoding.PEM))
    cert, key = _issued(ca, now, [*LOOPBACK, *hosts])
    _write(folder / KEY, _key_pem(key))
    _write(folder / CERT, cert.public_bytes(serialization.Encoding.PEM))
    return TLSFiles(str(folder / CERT), str(folder / KEY), str(folder / CA))


def _kept_ca(folder: Path, now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """The CA an earlier launch of this run made, where both its files are there and it has a day left."""
    cert_pem, key_pem = read_own(folder / CA), read_own(folder / CA_KEY)
    if cert_pem is None or key_pem is None:
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
        key = serialization.load_pem_private_key(key_pem.encode(), password=None)
        if cert.public_key() != key.public_key():
            raise ValueError("the key is not the certificate's")
    except ValueError as exc:
        raise InputError(
            f"{folder}: not the CA psgd made for this run ({exc}): remove the folder to have a new one made"
        ) from None
    if cert.not_valid_after_utc - now < datetime.timedelta(days=1):
        log.info("the job's CA in %s expires on %s: a new one is made", folder, cert.not_valid_after_utc)
        return None
    return cert, key


def _new_ca(now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "psgd job CA")])
    cert = (
        _builder(name, name, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _issued(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], now: datetime.datetime, names: list[str]
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate signed by ``ca`` for ``names``, good for serving (the shards) and for showing (the workers)."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    sans = []
    for name in dict.fromkeys(names):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    cert = (
        _builder(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "psgd job")]), ca_cert.subject, key.public_key(), now
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _builder(subject: x509.Name, issuer: x509.Name, public_key, now: datetime.datetime) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a clock a little behind still accepts it
        .not_valid_after(now + datetime.timedelta(days=DAYS))
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes) -> None:
    with open_own(path, "w", private=True, binary=True) as f:
        f.write(data)

"""TLS and mutual TLS for gRPC and for the bulk data path, from certificate files.

A shard with ``--tls-cert`` and ``--tls-key`` speaks only TLS; adding
``--tls-ca`` makes it demand client certificates signed by that CA (mutual
TLS).  A worker with ``--tls-ca`` trusts shards signed by that CA, and sends
``--tls-cert``/``--tls-key`` as its own certificate.  The certificate must
name the address the worker dials (a DNS name or an IP in subjectAltName).
docs/howto/reliability-security.md shows how to make a CA and certificates with openssl; ``psgd launch`` makes
its own on one node where it is given none (psgd/launcher/certs.py).
"""

from __future__ import annotations

import dataclasses
import socket
import ssl
from pathlib import Path

from psgd.errors import InputError


class TLSError(InputError):
    """A certificate file is missing or unreadable."""


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    cert: str | None = None  # this side's certificate chain (PEM)
    key: str | None = None  # its private key (PEM)
    ca: str | None = None  # the CA that signs the other side (PEM)

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def pem(self, which: str) -> bytes | None:
        """The bytes of the ``which`` file ("cert", "key" or "ca"); None where none is named."""
        path = getattr(self, which)
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise TLSError(f"--tls-{which} {path}: {exc.strerror or exc}") from None

    def check_server(self) -> None:
        if not (self.cert and self.key):
            raise TLSError("a TLS server needs both --tls-cert and --tls-key (and --tls-ca for mutual TLS)")

    def check_client(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TLSError("a client certificate needs both --tls-cert and --tls-key")

    # -- the data path -------------------------------------------------------------------
    def server_context(self) -> ssl.SSLContext:
        self.check_server()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.ca:
                ctx.load_verify_locations(self.ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as exc:
            raise TLSError(f"cannot load the TLS files: {exc}") from None
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            if self.ca:
                ctx.load_verify_locations(self.ca)
            else:
                ctx.load_default_certs()
            if self.cert or self.key:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise TLSError(f"cannot load the TLS files: {exc}") from None
        return ctx

    def wrap_client(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        return self.client_context().wrap_socket(sock, server_hostname=host)


NO_TLS = TLSFiles()


def add_tls_arguments(parser, server: bool = False, launch: bool = False) -> None:
    group = parser.add_argument_group(
        "TLS",
        "encryption and mutual authentication (certificates with openssl: docs/howto/reliability-security.md)"
        if not launch
        else "encryption and mutual authentication, on by default on one node with a CA "
        "made for the job in RUN/tls/ (your own certificates, made with openssl: "
        "docs/howto/reliability-security.md)",
    )
    if launch:
        group.add_argument(
            "--tls-cert",
            metavar="PEM",
            help="the certificate every shard serves with and every "
            "worker (and this launcher's own reads) shows; it must name 127.0.0.1, or each "
            "node's address with --hosts (all three flags together: mutual TLS)",
        )
        group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
        group.add_argument(
            "--tls-ca",
            metavar="PEM",
            help="the CA that signed --tls-cert: shards demand client "
            "certificates it signed, workers trust shards it signed. Without these three (here or in "
            "the job file's [tls]), one node makes a CA for the job and keeps it in RUN/tls/",
        )
        group.add_argument(
            "--no-tls",
            action="store_true",
            help="plaintext: the token, registration keys, "
            "gradients and weights travel in the clear (the default with --nnodes > 1 and no "
            "certificates)",
        )
    elif server:
        group.add_argument("--tls-cert", metavar="PEM", help="this shard's certificate; with --tls-key: TLS only")
        group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
        group.add_argument("--tls-ca", metavar="PEM", help="demand client certificates signed by this CA (mutual TLS)")
    else:
        group.add_argument(
            "--tls-ca", metavar="PEM", help="trust shards whose certificate this CA signed (enables TLS)"
        )
        group.add_argument("--tls-cert", metavar="PEM", help="this worker's certificate, for mutual TLS")
        group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")


def tls_from_args(args, config=None) -> TLSFiles:
    """The TLS files the flags name; where they name none, those of the job file ``config``'s [tls] table (if
    any)."""
    given = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca)
    if given.enabled or config is None:
        return given
    return TLSFiles(config.tls.cert or None, config.tls.key or None, config.tls.ca or None)


def launch_tls(args) -> TLSFiles | None:
    """``psgd launch``'s TLS: the files its flags name, plaintext with ``--no-tls``, else None (the job file's
    ``[tls]``, else a CA made for the job: :func:`psgd.launcher.run.launch`)."""
    given = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca)
    if args.no_tls:
        if given.enabled:
            raise TLSError("--no-tls with --tls-cert/--tls-key/--tls-ca: give one or the other")
        return NO_TLS
    return given if given.enabled else None


def child_flags(tls: TLSFiles) -> list[str]:
    """The flags that hand ``tls`` on to a psgd-server or psgd-worker (the same three for both: mutual TLS)."""
    if not tls.enabled:
        return []
    if not (tls.cert and tls.key and tls.ca):
        raise TLSError(
            "psgd launch with TLS needs --tls-cert, --tls-key and --tls-ca together: shards serve and "
            "workers show the certificate, and both trust the CA (mutual TLS)"
        )
    return [
        "--tls-cert",
        str(Path(tls.cert).resolve()),
        "--tls-key",
        str(Path(tls.key).resolve()),
        "--tls-ca",
        str(Path(tls.ca).resolve()),
    ]

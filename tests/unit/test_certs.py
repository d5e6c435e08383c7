"""The CA and certificate a single-node launch makes for its job (psgd/launcher/certs.py)."""

from __future__ import annotations

import datetime
import socket
import ssl
import stat
import threading

import pytest
from cryptography import x509

from psgd.errors import InputError
from psgd.launcher import certs
from psgd.launcher.certs import job_tls


def test_the_job_gets_a_ca_and_a_certificate_readable_by_its_user_alone(tmp_path):
    tls = job_tls(tmp_path, ["10.0.0.5", "node-a"])
    assert (tls.cert, tls.key, tls.ca) == tuple(str(tmp_path / "tls" / n) for n in ("job.pem", "job.key", "ca.pem"))
    for name in ("ca.pem", "ca.key", "job.pem", "job.key"):
        assert stat.S_IMODE((tmp_path / "tls" / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "job.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.0.0.5"}
    assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "node-a"}
    days = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert datetime.timedelta(days=certs.DAYS) <= days < datetime.timedelta(days=certs.DAYS + 1)


def test_a_shard_and_a_worker_with_the_made_files_agree_on_mutual_tls(tmp_path):
    """The same three files serve (the shard) and show a client certificate (the worker), as child_flags hands
    them to both; a client without the certificate is refused."""
    tls = job_tls(tmp_path)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    said = []

    def serve() -> None:
        server.settimeout(10)
        for _ in range(2):  # the worker's connection, then the one without a certificate
            conn, _ = server.accept()
            try:
                with tls.server_context().wrap_socket(conn, server_side=True) as s:
                    s.sendall(b"ok")
                    said.append(s.getpeercert()["subject"])
            except (ssl.SSLError, OSError) as exc:
                said.append(type(exc).__name__)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with tls.wrap_client(socket.create_connection(("127.0.0.1", port), timeout=10), "127.0.0.1") as s:
        assert s.recv(2) == b"ok"
    anonymous = ssl.create_default_context(cafile=tls.ca)
    with pytest.raises((ssl.SSLError, OSError)):
        with anonymous.wrap_socket(
            socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="127.0.0.1"
        ) as s:
            s.recv(2)
    t.join(15)
    server.close()
    assert said[0] == ((("commonName", "psgd job"),),) and said[1] != said[0]


def test_a_resumed_run_keeps_its_ca(tmp_path):
    first = job_tls(tmp_path)
    ca, ca_key = (tmp_path / "tls" / "ca.pem").read_bytes(), (tmp_path / "tls" / "ca.key").read_bytes()
    leaf = (tmp_path / "tls" / "job.pem").read_bytes()
    second = job_tls(tmp_path)
    assert second == first
    assert (tmp_path / "tls" / "ca.pem").read_bytes() == ca and (tmp_path / "tls" / "ca.key").read_bytes() == ca_key
    assert (tmp_path / "tls" / "job.pem").read_bytes() != leaf  # a new certificate, from the same CA


def test_a_ca_about_to_expire_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(certs, "DAYS", 0)  # made to last five minutes (it starts five minutes back)
    job_tls(tmp_path)
    ca = (tmp_path / "tls" / "ca.pem").read_bytes()
    monkeypatch.setattr(certs, "DAYS", 30)
    job_tls(tmp_path)
    assert (tmp_path / "tls" / "ca.pem").read_bytes() != ca


@pytest.mark.parametrize("planted", ["ca.key", "job.key", "ca.pem"])
def test_a_planted_link_is_never_written_through(tmp_path, planted):
    (tmp_path / "tls").mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("theirs")
    (tmp_path / "tls" / planted).symlink_to(target)
    with pytest.raises(InputError, match="symbolic link"):
        job_tls(tmp_path)
    assert target.read_text() == "theirs"


def test_a_linked_tls_folder_is_refused(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "tls").symlink_to(tmp_path / "other")
    with pytest.raises(InputError, match="not a folder of psgd's own"):
        job_tls(tmp_path)
    assert not list((tmp_path / "other").iterdir())


def test_a_tampered_ca_is_one_line(tmp_path):
    job_tls(tmp_path)
    (tmp_path / "tls" / "ca.key").write_bytes(job_tls.__doc__.encode())
    with pytest.raises(InputError, match="not the CA psgd made for this run"):
        job_tls(tmp_path)

"""The private CA and the mutual TLS 1.3 admission rules, in-process (no model)."""

from __future__ import annotations

import json
import socket
import ssl
import stat
import threading

import pytest

from muser.errors import HandoffRefused, MuserError
from muser.handoff import certs as C


def test_init_issue_files_and_modes(tmp_path):
    d = tmp_path / "c"
    C.init(d)
    crt = C.issue(d, "node-1")
    for f in ("ca.key", "hmac.key", "node-1.key"):
        assert stat.S_IMODE((d / f).stat().st_mode) == 0o600, f
    assert len((d / "hmac.key").read_bytes()) == 32
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(crt.read_bytes())
    from cryptography.hazmat.primitives import serialization

    assert json.loads((d / "peers.json").read_text()) == {
        "node-1": C.fingerprint(cert.public_bytes(serialization.Encoding.DER))}
    with pytest.raises(MuserError, match="refusing to replace a CA"):
        C.init(d)
    with pytest.raises(MuserError, match="issued before"):
        C.issue(d, "node-1")
    with pytest.raises(MuserError, match="peer name"):
        C.issue(d, "Bad Name")
    with pytest.raises(MuserError, match="certs init"):
        C.issue(tmp_path / "none", "x")


def _handshake(server: C.Certs, client: C.Certs, allow=None):
    """One loopback handshake; returns (server-side result, client-side result)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    result: dict = {}

    def serve():
        raw, _ = lsock.accept()
        s = None
        try:
            s = server.server_context().wrap_socket(raw, server_side=True)
            result["server"] = server.check_peer(s, allow)
            s.sendall(b"ok")
        except (ssl.SSLError, OSError, HandoffRefused) as e:
            result["server"] = e
        finally:
            (s or raw).close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        c = client.client_context().wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5))
        result["client"] = client.check_peer(c, None)
        result["version"] = c.version()
        result["read"] = c.recv(2)
        c.close()
    except (ssl.SSLError, OSError, HandoffRefused) as e:
        result.setdefault("client", e)
        result["read"] = e
    t.join(10)
    lsock.close()
    return result


def test_mutual_tls_admission(certs_dir, other_ca, tmp_path):
    prefill, decode = C.Certs.load(certs_dir, "prefill"), C.Certs.load(certs_dir, "decode")
    r = _handshake(prefill, decode)
    assert r["server"] == "decode" and r["client"] == "prefill" and r["read"] == b"ok"
    assert r["version"] == "TLSv1.3"
    # no client certificate: the server's handshake refuses it
    r = _handshake(prefill, C.Certs.load(certs_dir, None))
    assert isinstance(r["server"], ssl.SSLError) and isinstance(r["read"], (ssl.SSLError, OSError))
    # a certificate from another CA, either side
    r = _handshake(prefill, C.Certs.load(other_ca, "decode"))
    assert isinstance(r["server"], (ssl.SSLError, OSError)) and not isinstance(r.get("read"), bytes)
    # a valid certificate whose name is not allowed
    r = _handshake(prefill, decode, allow=["someone-else"])
    assert isinstance(r["server"], HandoffRefused) and "not allowed" in str(r["server"])
    # a name whose fingerprint on record differs (re-issued elsewhere / revoked)
    d2 = tmp_path / "copy"
    d2.mkdir()
    for f in certs_dir.iterdir():
        (d2 / f.name).write_bytes(f.read_bytes())
    peers = json.loads((d2 / "peers.json").read_text())
    peers["decode"] = "0" * 64
    (d2 / "peers.json").write_text(json.dumps(peers))
    r = _handshake(C.Certs.load(d2, "prefill"), decode)
    assert isinstance(r["server"], HandoffRefused) and "peers.json records" in str(r["server"])


def test_cli(tmp_path, capsys):
    from muser.cli import main

    d = tmp_path / "cli"
    assert main(["certs", "init", str(d)]) == 0
    assert main(["certs", "issue", str(d), "prefill"]) == 0
    assert C.load_peers(d)["prefill"] in capsys.readouterr().out
    assert main(["certs", "issue", str(d), "prefill"]) == 2
    assert main(["certs", "init", str(d)]) == 2
    assert "refusing to replace a CA" in capsys.readouterr().err
    for argv, msg in ((["--listen", ":0", "--certs", str(d)], "must be HOST:PORT"),
                      (["--listen", "127.0.0.1:0", "--certs", str(tmp_path / "none")], "certs init"),
                      (["--listen", "127.0.0.1:0", "--certs", str(d), "--name", "decode"], "certs issue"),
                      (["--listen", "127.0.0.1:0", "--certs", str(d), "--threads", "0"], "--threads")):
        assert main(["prefill-node", *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1

"""TLS stores against real servers: nginx serving HTTPS and redis-server speaking only TLS, each with
a server certificate this test signs with a CA it makes (``openssl``), started on free ports and
stopped by PID. A client trusting that CA (``ca_file``, or ``KVCODEC_STORE_CA_FILE``) works; one
trusting another CA, or only the system CAs, is refused as ``StoreUnavailable``. A 3-node redis
cluster speaks TLS to clients and on its bus (``rediss+cluster://``).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcodec.errors import ConfigError, StoreUnavailable
from kvcodec.settings import Settings
from kvcodec.store import open_store
from kvcodec.store.http import HttpStore
from kvcodec_tools.ports import free_port, free_port_run
from kvcodec_tools.services.nginx import NginxStore
from kvcodec_tools.services.redis import RedisCluster, RedisServer
from kvcodec_tools.services.seaweedfs import SeaweedS3

pytestmark = pytest.mark.integration

TOKEN = "tls-token-0123456789"
PASSWORD = "tls-password-42"
KEY = "0a1b2c3d4e5f/abcdefabcdef/" + "2" * 40


def _openssl(*args: str, cwd: Path) -> None:
    tool = shutil.which("openssl")
    if tool is None:
        message = "openssl is not installed (apt-get install -y openssl)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    subprocess.run([tool, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_ca(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=folder)
    return folder / f"{name}.pem"


def make_server_cert(folder: Path, ca: Path) -> tuple:
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "server.key",
             "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=folder)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", str(ca), "-CAkey", str(ca.with_suffix(".key")),
             "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.ext", cwd=folder)
    return folder / "server.pem", folder / "server.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root, "kvcodec-test-ca")
    other = make_ca(root / "other", "some-other-ca")
    cert, key = make_server_cert(root, ca)
    return {"ca": ca, "other": other, "cert": cert, "key": key}


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    monkeypatch.delenv("KVCODEC_STORE_TOKEN", raising=False)
    monkeypatch.delenv("KVCODEC_STORE_CA_FILE", raising=False)


@pytest.mark.timeout(60)
def test_https_store_verifies_the_server_against_the_ca_bundle(pki, tmp_path, monkeypatch):
    with NginxStore(tmp_path, "127.0.0.1", free_port(), TOKEN, tls=(pki["cert"], pki["key"])) as srv:
        assert srv.url.startswith("https://")
        with HttpStore(srv.url, token=TOKEN, ca_file=str(pki["ca"])) as s:
            s.put(KEY, b"over TLS" * 1000)
            assert s.get(KEY) == b"over TLS" * 1000 and s.get_range(KEY, 2, 5) == b"er " and s.exists(KEY)
            assert {e.key for e in s.scan()} == {KEY}
        monkeypatch.setenv("KVCODEC_STORE_TOKEN", TOKEN)
        monkeypatch.setenv("KVCODEC_STORE_CA_FILE", str(pki["ca"]))
        with open_store(srv.url) as from_env:  # the CA bundle from the setting's variable
            assert from_env.get(KEY) == b"over TLS" * 1000
        with open_store(srv.url, ca_file=str(pki["other"])) as wrong:
            with pytest.raises(StoreUnavailable, match=r"TLS certificate not accepted against .*some-other-ca"):
                wrong.get(KEY)
        monkeypatch.delenv("KVCODEC_STORE_CA_FILE")
        with open_store(srv.url) as system:  # the system CAs do not know the test's CA
            with pytest.raises(StoreUnavailable, match="TLS certificate not accepted against the system CAs"):
                system.put(KEY, b"x")
        with open_store(srv.url.replace("https://", "http://")) as plain:  # plain HTTP to a TLS port
            with pytest.raises(StoreUnavailable):
                plain.get(KEY)


@pytest.mark.timeout(60)
def test_rediss_store_verifies_the_server_against_the_ca_bundle(pki, tmp_path):
    with RedisServer(tmp_path, "127.0.0.1", free_port(), PASSWORD, tls=(pki["cert"], pki["key"], pki["ca"])) as srv:
        assert srv.url.startswith("rediss://")
        with open_store(srv.url, ca_file=str(pki["ca"])) as s:
            s.put(KEY, b"over TLS")
            assert s.get(KEY) == b"over TLS" and s.get_range(KEY, 0, 4) == b"over"
            assert [e.key for e in s.scan()] == [KEY]
        with open_store(srv.url, ca_file=str(pki["other"])) as wrong:
            with pytest.raises(StoreUnavailable, match=r"TLS certificate not accepted against .*some-other-ca"):
                wrong.get(KEY)
        with open_store(srv.url.replace("rediss://", "redis://")) as plain:  # no TLS: the server hangs up
            with pytest.raises(StoreUnavailable):
                plain.get(KEY)


@pytest.mark.timeout(90)
def test_rediss_cluster_store_verifies_every_node_against_the_ca_bundle(pki, tmp_path):
    base = free_port_run(3, offsets=(0, 10000))
    with RedisCluster(tmp_path, "127.0.0.1", base, PASSWORD, tls=(pki["cert"], pki["key"], pki["ca"])) as cluster:
        assert cluster.url.startswith("rediss+cluster://")
        keys = [KEY[:-1] + str(i) for i in range(8)]  # spread over the three nodes' slots
        with open_store(cluster.url, ca_file=str(pki["ca"])) as s:
            assert s.url.startswith("rediss+cluster://") and s.tls
            for i, key in enumerate(keys):
                s.put(key, b"cluster %d" % i)
            assert [s.get(k) for k in keys] == [b"cluster %d" % i for i in range(8)]
            assert sorted(e.key for e in s.scan()) == sorted(keys)
        with open_store(cluster.url, ca_file=str(pki["other"])) as wrong:
            with pytest.raises(StoreUnavailable, match="TLS certificate not accepted"):
                wrong.get(keys[0])
        with open_store(cluster.url.replace("rediss+cluster://", "redis+cluster://")) as plain:
            with pytest.raises(StoreUnavailable):
                plain.get(keys[0])


@pytest.mark.timeout(90)
def test_s3_over_https_verifies_the_server_against_the_ca_bundle(pki, tmp_path, monkeypatch):
    srv = SeaweedS3(tmp_path, "127.0.0.1", "tls-key-0001", "tls-secret-000000001", bucket="kvtls",
                    tls=(pki["cert"], pki["key"]))
    with srv:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            monkeypatch.delenv(name)
        for name, value in srv.environ().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", srv.https_endpoint)
        with open_store(srv.url, ca_file=str(pki["ca"])) as s:
            assert s.endpoint.startswith("https://")
            s.put(KEY, b"over TLS")
            assert s.get(KEY) == b"over TLS" and s.get_range(KEY, 5, 8) == b"TLS"
        monkeypatch.setenv("KVCODEC_STORE_CA_FILE", str(pki["other"]))
        with open_store(srv.url + "?attempts=1") as wrong:  # the CA bundle from the setting's variable
            with pytest.raises(StoreUnavailable, match=r"TLS certificate not accepted against .*some-other-ca"):
                wrong.get(KEY)


def test_a_ca_bundle_that_is_not_there_is_a_config_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="CA bundle"):
        HttpStore("https://127.0.0.1:1/kv", ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="CA bundle"):
        open_store("rediss://:pw@127.0.0.1:1/0", ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="CA bundle"):
        open_store("s3://bucket/kv", ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="store_ca_file"):
        Settings.load({"store_ca_file": str(tmp_path / "missing.pem")}, env={})
    ca = tmp_path / "ca.pem"
    ca.write_text("not read here")
    s = Settings.load({"store_ca_file": str(ca)}, env={})
    assert s.store_ca_file == str(ca) and s.environ()["KVCODEC_STORE_CA_FILE"] == str(ca)
    assert Settings.load(env={}).store_ca_file == ""
    assert os.environ.get("KVCODEC_STORE_CA_FILE") is None

"""The gRPC endpoint over mutual TLS (``kvcodec serve --grpc-tls-cert/--grpc-tls-key/--grpc-tls-client-ca``),
with certificates this test makes (``openssl``): a client with the CA and a certificate that CA
signed is served; one without a certificate, with another CA's, or in plain text is refused; the
CLI's ``--tls-*`` options reach the client."""
from __future__ import annotations

import subprocess

import pytest

from kvcodec_client import ClientError, ClientTls, KVCodecClient
from kvcodec_tools.tritonserver import GrpcTls, Ports, TritonServer

from .conftest import KVCODEC, REPO, free_ports
from .test_store_tls import _openssl, make_ca, make_server_cert

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def make_client_cert(folder, ca, name: str = "client"):
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca), "-CAkey", str(ca.with_suffix(".key")),
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "client.ext", cwd=folder)
    return folder / f"{name}.pem", folder / f"{name}.key"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, settings):
    root = tmp_path_factory.mktemp("grpc-pki")
    ca = make_ca(root, "kvcodec-grpc-ca")
    cert, key = make_server_cert(root, ca)
    client = make_client_cert(root, ca)
    other_root = root / "other"
    other_ca = make_ca(other_root, "other-ca")
    stranger = make_client_cert(other_root, other_ca, "stranger")
    server = TritonServer(REPO / "model_repository", settings, Ports(*free_ports(3)),
                          log_path=root / "tritonserver.log", tls=GrpcTls(cert, key, client_ca=ca))
    server.start(timeout_s=300)
    try:
        yield server, ca, client, stranger
    finally:
        server.stop()


def test_a_client_with_a_certificate_the_ca_signed_is_served(tls_server):
    server, ca, (cert, key), _ = tls_server
    result = KVCodecClient(server.grpc_url, "grpc", tls=ClientTls(str(ca), str(cert), str(key))).generate("ping", 2)
    assert len(result.tokens) == 2


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate", "plain text"])
def test_clients_without_the_credentials_are_refused(tls_server, who):
    server, ca, _, (s_cert, s_key) = tls_server
    tls = {"no certificate": ClientTls(str(ca)), "another CA's certificate": ClientTls(str(ca), str(s_cert), str(s_key)),
           "plain text": None}[who]
    with pytest.raises(ClientError):
        KVCodecClient(server.grpc_url, "grpc", timeout_s=20, tls=tls).generate("ping", 2)


def test_the_cli_speaks_tls(tls_server):
    server, ca, (cert, key), _ = tls_server
    probe = [KVCODEC, "probe", "--url", server.grpc_url, "--timeout-s", "20"]
    ok = subprocess.run([*probe, "--tls-ca", str(ca), "--tls-cert", str(cert), "--tls-key", str(key)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "failed" in refused.stderr


def test_the_balancer_terminates_mutual_tls_in_front_of_http_and_grpc(server, tls_server, tmp_path):
    """The documented recipe for the HTTP endpoint: nginx with TLS and a client-certificate check in
    front of a plain server; a client without a certificate is refused by nginx (400)."""
    from kvcodec_tools.services.balancer import Balancer, BalancerTls

    _, ca, (cert, key), (s_cert, s_key) = tls_server
    pki = ca.parent
    http_port, grpc_port = free_ports(2)
    tls = BalancerTls(pki / "server.pem", pki / "server.key", client_ca=ca)
    with Balancer(tmp_path / "balancer", "127.0.0.1", http_port, grpc_port,
                  [(server.ports.http, server.ports.grpc)], tls=tls) as balancer:
        good = ClientTls(str(ca), str(cert), str(key))
        for protocol, url in (("http", balancer.http_url), ("grpc", balancer.grpc_url)):
            assert len(KVCodecClient(url, protocol, tls=good).generate("ping", 2).tokens) == 2
        for tls_ in (ClientTls(str(ca)), ClientTls(str(ca), str(s_cert), str(s_key))):
            with pytest.raises(ClientError) as refused:
                KVCodecClient(balancer.http_url, "http", timeout_s=20, tls=tls_).generate("ping", 2)
            assert refused.value.status == "400", refused.value.message
        with pytest.raises(ClientError):
            KVCodecClient(balancer.http_url, "http", timeout_s=20).generate("ping", 2)  # plain HTTP to TLS

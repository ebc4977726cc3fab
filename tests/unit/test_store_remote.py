"""Remote stores below the servers: URL parsing, keys, ranges, HTTP status mapping (a stdlib HTTP
server in this process), and the service configs. The real nginx/redis runs are in
tests/integration/test_stores.py."""
from __future__ import annotations

import http.server
import threading
import uuid

import pytest

from kvcodec.errors import BadRequest, ConfigError, StoreUnavailable
from kvcodec.store import open_store
from kvcodec.store.fs import FileStore
from kvcodec.store.http import HttpStore
from kvcodec.store.memory import MemoryStore
from kvcodec.store.redis_store import RedisClusterStore, RedisStore

KEY = "0a1b2c3d4e5f/abcdefabcdef/" + "0" * 40


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch):
    monkeypatch.delenv("KVCODEC_STORE_TOKEN", raising=False)


# -- get_range on the local stores (the base class default) ------------------------------------------

@pytest.fixture(params=["file", "memory"])
def local(request, tmp_path):
    s = FileStore(tmp_path / "s") if request.param == "file" else MemoryStore(f"unit-{uuid.uuid4().hex}")
    yield s
    s.close()


def test_get_range_slices_like_python(local):
    assert local.get_range(KEY, 0, 4) is None
    local.put(KEY, b"0123456789")
    assert local.get_range(KEY, 2, 5) == b"234"
    assert local.get_range(KEY, 0, 10) == b"0123456789"
    assert local.get_range(KEY, 8, 100) == b"89"
    assert local.get_range(KEY, 50, 60) == b""
    assert local.get_range(KEY, 3, 3) == b""


@pytest.mark.parametrize("start, end", [(-1, 3), (5, 2), (1.0, 2), (0, None)])
def test_get_range_rejects_bad_ranges(local, start, end):
    with pytest.raises(BadRequest, match="bad byte range"):
        local.get_range(KEY, start, end)


# -- URL parsing ----------------------------------------------------------------------------------

def test_http_url_parsing():
    s = open_store("http://127.0.0.1:8080/kv/")
    assert isinstance(s, HttpStore)
    assert (s.host, s.port, s.prefix, s.url) == ("127.0.0.1", 8080, "/kv", "http://127.0.0.1:8080/kv")
    assert HttpStore("http://example.org").prefix == "" and HttpStore("http://example.org").port == 80
    t = open_store("http://h:1/a/b?timeout_s=2.5&connect_timeout_s=0.5")
    assert (t.prefix, t.timeout_s, t.connect_timeout_s) == ("/a/b", 2.5, 0.5)


@pytest.mark.parametrize("url, match", [
    ("http://user:secret@h:1/kv", "must not carry credentials"),
    ("http://:secret@h:1/kv", "must not carry credentials"),
    ("http://h:99999/kv", "bad port"),
    ("http:///kv", "names no host"),
    ("http://h:1/kv?token=x", "option 'token' is unknown"),
    ("http://h:1/kv?timeout_s=soon", "is not a number"),
    ("http://h:1/kv?timeout_s=0", "timeout_s must be > 0"),
])
def test_http_url_rejections(url, match):
    with pytest.raises(ConfigError, match=match):
        open_store(url)


def test_http_token_from_argument_or_environment_never_in_the_url(monkeypatch):
    assert HttpStore("http://h:1/kv")._headers == {}
    monkeypatch.setenv("KVCODEC_STORE_TOKEN", "from-env")
    s = open_store("http://h:1/kv")
    assert s._headers == {"Authorization": "Bearer from-env"} and "from-env" not in s.url
    assert HttpStore("http://h:1/kv", token="given")._headers == {"Authorization": "Bearer given"}


def test_redis_url_parsing(monkeypatch):
    s = open_store("redis://:p%40ss@10.0.0.2:7000/3?timeout_s=1&prefix=t:")
    assert isinstance(s, RedisStore)
    assert (s.host, s.port, s.db, s.password, s.username, s.prefix) == ("10.0.0.2", 7000, 3, "p@ss", None, "t:")
    assert s.url == "redis://:***@10.0.0.2:7000/3" and s.timeout_s == 1.0
    bare = open_store("redis://h")
    assert (bare.port, bare.db, bare.password, bare.url) == (6379, 0, None, "redis://h:6379/0")
    user = open_store("redis://alice:pw@h:1")
    assert (user.username, user.password) == ("alice", "pw")
    monkeypatch.setenv("KVCODEC_STORE_TOKEN", "env-pw")
    assert open_store("redis://h:1").password == "env-pw"
    assert open_store("redis://:url-pw@h:1").password == "url-pw"


def test_redis_cluster_url_parsing():
    s = open_store("redis+cluster://:pw@a:7000,b:7001,[::1]:7002")
    assert isinstance(s, RedisClusterStore)
    assert s.nodes == [("a", 7000), ("b", 7001), ("::1", 7002)] and s.password == "pw"
    assert s.url == "redis+cluster://:***@a:7000,b:7001,::1:7002"


@pytest.mark.parametrize("url, match", [
    ("redis://:pw@a:1,b:2", "use redis\\+cluster://"),
    ("redis://h:1/x", "database 'x' is not a number"),
    ("redis://h:port", "bad address"),
    ("redis://", "names no host"),
    ("redis://h:1?ssl=1", "option 'ssl' is unknown"),
    ("redis://h:1?prefix={tag}", "without hash tags"),
    ("redis+cluster://a:1,b:2/4", "only database 0"),
    ("redis+cluster://a:1,:2", "bad address"),
])
def test_redis_url_rejections(url, match):
    with pytest.raises(ConfigError, match=match):
        open_store(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/kv", "redis://127.0.0.1:9/0", "redis+cluster://127.0.0.1:9"])
@pytest.mark.parametrize("key", ["../x", "A", "", None, "a b"])
def test_remote_stores_check_keys_before_any_io(url, key):
    s = open_store(url)  # port 9 (discard): nothing listens, so any I/O would raise StoreUnavailable
    for op in (s.get, s.exists, s.delete, lambda k: s.put(k, b"x"), lambda k: s.get_range(k, 0, 1)):
        with pytest.raises(BadRequest):
            op(key)


# -- HTTP status mapping, through a stdlib server ---------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    answers: dict = {}  # method -> (status, body)
    seen: list = []

    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        self.seen.append((self.command, self.path, self.headers.get("Authorization"), self.headers.get("Range")))
        status, body = self.answers.get(self.command, (404, b""))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def fake():
    _Handler.answers, _Handler.seen = {}, []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}/kv"
    srv.shutdown()
    srv.server_close()
    t.join(5)


def test_http_requests_paths_and_headers(fake):
    srv, url = fake
    _Handler.answers = {"GET": (206, b"bc"), "PUT": (201, b""), "HEAD": (200, b"")}
    with HttpStore(url, token="tok") as s:
        assert s.get_range(KEY, 1, 3) == b"bc"
        s.put(KEY, b"abc")
        assert s.exists(KEY)
    path = f"/kv/{KEY}.kvc"
    assert _Handler.seen == [("GET", path, "Bearer tok", "bytes=1-2"), ("PUT", path, "Bearer tok", None),
                             ("HEAD", path, "Bearer tok", None)]


def test_http_status_mapping(fake):
    srv, url = fake
    s = HttpStore(url)
    _Handler.answers = {}  # 404 everywhere: a miss, and deleting what is not there is fine
    assert s.get(KEY) is None and s.exists(KEY) is False and s.get_range(KEY, 0, 1) is None
    s.delete(KEY)
    _Handler.answers = {"GET": (200, b"0123456789")}  # a server that ignores Range
    assert s.get_range(KEY, 2, 4) == b"23"
    _Handler.answers = {"GET": (416, b"")}
    assert s.get_range(KEY, 100, 200) == b""
    _Handler.answers = {"PUT": (401, b""), "DELETE": (403, b""), "GET": (503, b"")}
    with pytest.raises(StoreUnavailable, match=r"refused the write .*HTTP 401.*no token is set"):
        s.put(KEY, b"x")
    with pytest.raises(StoreUnavailable, match=r"refused the write .*HTTP 403"):
        s.delete(KEY)
    with pytest.raises(StoreUnavailable, match="answered HTTP 503"):
        s.get(KEY)
    with pytest.raises(StoreUnavailable, match="token was not accepted"):
        HttpStore(url, token="bad").put(KEY, b"x")


def test_http_keeps_one_connection_per_thread_and_survives_a_dropped_one(fake):
    srv, url = fake
    _Handler.answers = {"GET": (200, b"v")}
    s = HttpStore(url)
    assert s.get(KEY) == b"v" and s.get(KEY) == b"v"
    assert len(s._all) == 1
    s._all[0].sock.close()  # as if the server had closed the idle keep-alive connection
    s._all[0].sock = None
    assert s.get(KEY) == b"v"
    done = []
    t = threading.Thread(target=lambda: done.append(s.get(KEY)))
    t.start()
    t.join(10)
    assert done == [b"v"] and len(s._all) == 2
    s.close()
    assert s._all == []
    with pytest.raises(StoreUnavailable, match="is closed"):
        s.get(KEY)


def test_http_server_down_is_store_unavailable():
    from kvcodec_tools.ports import free_port

    s = HttpStore(f"http://127.0.0.1:{free_port()}/kv", connect_timeout_s=1)
    with pytest.raises(StoreUnavailable, match="unreachable"):
        s.get(KEY)
    with pytest.raises(ConnectionError):  # StoreUnavailable is also the built-in
        s.put(KEY, b"x")


# -- service configs (no process started) -----------------------------------------------------------

def test_nginx_config_guards_writes_and_stays_in_its_folder(tmp_path):
    from kvcodec_tools.services.nginx import NginxStore

    srv = NginxStore(tmp_path, "127.0.0.1", 18080, "tok-12345678")
    assert srv.url == "http://127.0.0.1:18080/kv" and srv.pid is None
    conf = srv._write_config().read_text()
    assert "daemon off;" in conf and "master_process on;" in conf
    assert '"1:Bearer tok-12345678" 0;' in conf and "return 401;" in conf
    assert f"alias {tmp_path.resolve()}/data/;" in conf and "dav_methods PUT DELETE MKCOL;" in conf
    paths = [w.rstrip(";") for w in conf.split() if w.startswith("/") and w not in ("/kv/", "/")]  # not locations
    assert paths and all(p.startswith(str(tmp_path.resolve())) for p in paths), paths
    assert (srv._write_config().stat().st_mode & 0o077) == 0  # it holds the token


@pytest.mark.parametrize("token", ["short", 'has"quote-xxxxx', "has space xxxxx", "semi;colon-xxxx", None])
def test_nginx_rejects_tokens_it_cannot_quote(tmp_path, token):
    from kvcodec_tools.procs import ServiceError
    from kvcodec_tools.services.nginx import NginxStore

    with pytest.raises(ServiceError, match="token"):
        NginxStore(tmp_path, "127.0.0.1", 1, token)


def test_redis_service_urls_quote_the_password(tmp_path):
    from kvcodec_tools.services.redis import RedisCluster, RedisServer

    one = RedisServer(tmp_path, "127.0.0.1", 7000, "a/b@c")
    assert one.url == "redis://:a%2Fb%40c@127.0.0.1:7000/0"
    assert open_store(one.url).password == "a/b@c"
    cluster = RedisCluster(tmp_path, "10.77.0.2", 7100, "pw")
    assert cluster.url == "redis+cluster://:pw@10.77.0.2:7100,10.77.0.2:7101,10.77.0.2:7102"
    assert [n.cluster_bus_port for n in cluster._nodes] == [17100, 17101, 17102]


def test_wrap_is_applied_to_the_launched_command(tmp_path):
    from kvcodec_tools.procs import Process

    p = Process("x", ["server", "--flag"], tmp_path / "log", wrap=lambda cmd: ["ip", "netns", "exec", "ns1", *cmd])
    assert p.cmd == ["ip", "netns", "exec", "ns1", "server", "--flag"]


def test_a_missing_server_binary_is_an_error_naming_the_package(tmp_path, monkeypatch):
    import kvcodec_tools.services as services
    from kvcodec_tools.procs import ServiceError
    from kvcodec_tools.services.nginx import NginxStore
    from kvcodec_tools.services.redis import RedisServer

    monkeypatch.setattr(services.shutil, "which", lambda name: None)
    monkeypatch.setattr(services.os, "access", lambda path, mode: False)
    with pytest.raises(ServiceError, match=r"nginx is not installed \(apt-get install -y nginx\)"):
        NginxStore(tmp_path, "127.0.0.1", 1, "token-12345678").start()
    with pytest.raises(ServiceError, match="redis-server is not installed"):
        RedisServer(tmp_path, "127.0.0.1", 1, "pw").start()

"""nginx as an HTTP chunk store: ``NginxStore(root, host, port, token).url`` -> ``http://HOST:PORT/kv``.

Serves ``root/data`` (the filesystem store's layout: ``<key>.kvc``) at ``/<prefix>/``. GET and HEAD
(with Range, and a folder's listing as JSON) are open to everyone; PUT, DELETE and MKCOL need ``Authorization: Bearer <token>``
(401 otherwise). PUT goes through nginx's temporary file and a rename, so it is atomic; a PUT with
``If-None-Match: *`` over an existing chunk is answered 412 (a create, as ``HttpStore.put`` sends).
Everything nginx writes (config, pid, logs, temp files) lives in ``root/nginx``.
"""
from __future__ import annotations

import grp
import os
import pwd
import re
from pathlib import Path
from typing import Optional, Sequence, Tuple

from kvcodec_tools.procs import Process, ServiceError, Wrap

from . import binary, can_connect

_TOKEN = re.compile(r"^[A-Za-z0-9._~+/=-]{8,512}$")  # RFC 6750 token68, nothing to escape in nginx.conf
_PREFIX = re.compile(r"^[a-z0-9_-]{1,64}$")

CONF = """\
{user}worker_processes {workers};
daemon off;
master_process on;
pid {run}/nginx.pid;
error_log {run}/error.log warn;

events {{
    worker_connections 256;
}}

http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 65;
    keepalive_requests 100000;
    client_max_body_size 0;
    client_body_buffer_size 1m;
    client_body_temp_path {run}/client_body;
    proxy_temp_path {run}/proxy;
    fastcgi_temp_path {run}/fastcgi;
    uwsgi_temp_path {run}/uwsgi;
    scgi_temp_path {run}/scgi;
    types {{ }}
    default_type application/octet-stream;

    # 1 when a request may change the data and does not carry the token.
    map $request_method $kv_write {{
        default 1;
        GET 0;
        HEAD 0;
    }}
    map "$kv_write:$http_authorization" $kv_denied {{
        default 1;
        "~^0:" 0;
        "1:Bearer {token}" 0;
    }}

    server {{
        listen {listen};
        server_name _;{tls}
        location /{prefix}/ {{
            if ($kv_denied) {{
                return 401;
            }}
            alias {data}/;
            # a create (PUT with If-None-Match: *, as HttpStore.put sends) over an existing chunk: 412
            # (the dav module ignores the header; checked, then written by the dav module's rename)
            set $kv_create "$request_method:$http_if_none_match";
            if (-f $request_filename) {{
                set $kv_create "$kv_create:taken";
            }}
            if ($kv_create = "PUT:*:taken") {{
                return 412;
            }}
            dav_methods PUT DELETE MKCOL;  # MKCOL: HttpStore.put claims a key first (mkdir: one writer wins)
            create_full_put_path on;
            dav_access user:rw group:r all:r;
            autoindex on;  # a folder's listing as JSON: HttpStore.scan (kvcodec store usage / gc)
            autoindex_format json;
        }}
        location / {{
            return 404;
        }}
    }}
}}
"""


def user_line() -> str:
    """nginx.conf's ``user`` line: as root, workers would drop to nobody, who cannot write root's folders."""
    if os.geteuid() != 0:
        return ""
    return f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};\n"


def start_nginx(name: str, run_dir: Path, conf: Path, host: str, ports: Sequence[int], wrap: Wrap,
                timeout_s: float) -> Process:
    """nginx on ``conf`` (pid, logs and temp files in ``run_dir``), ready once it listens on ``ports``."""
    nginx = binary("nginx", "nginx")
    log = run_dir / "stdout.log"
    pid_file = run_dir / "nginx.pid"
    pid_file.unlink(missing_ok=True)
    cmd = [nginx, "-p", str(run_dir), "-c", str(conf), "-e", str(run_dir / "error.log")]
    process = Process(name, cmd, log, wrap).start()

    def ready() -> bool:
        # nginx writes its pid file (removed above) after binding its sockets, so a listener
        # found then is ours, not someone else's on the same port.
        try:
            int(pid_file.read_text().strip())
        except (OSError, ValueError):
            return False
        return all(can_connect(host, port) for port in ports)

    process.wait_ready(ready, timeout_s, [log, run_dir / "error.log"])
    return process


class NginxStore:
    def __init__(self, root: Path, host: str, port: int, token: str, prefix: str = "kv", wrap: Wrap = None,
                 workers: int = 1, tls: Optional[Tuple[Path, Path]] = None) -> None:
        """``tls``: (certificate chain, private key) PEM files: serve HTTPS (``.url`` is ``https://``)."""
        if not isinstance(token, str) or not _TOKEN.match(token):
            raise ServiceError("nginx store token must be 8-512 characters of [A-Za-z0-9._~+/=-]")
        if not _PREFIX.match(prefix):
            raise ServiceError(f"nginx store prefix must match [a-z0-9_-]{{1,64}}, got {prefix!r}")
        self.root, self.host, self.port, self.token, self.prefix = Path(root).resolve(), host, int(port), token, prefix
        self.wrap, self.workers = wrap, int(workers)
        self.data = self.root / "data"
        self.run_dir = self.root / "nginx"
        listen_host = f"[{host}]" if ":" in host else host
        self.tls = (Path(tls[0]).resolve(), Path(tls[1]).resolve()) if tls else None
        self.url = f"{'https' if tls else 'http'}://{listen_host}:{self.port}/{prefix}"
        self._process: Optional[Process] = None

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process else None

    def _write_config(self) -> Path:
        self.data.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        user = user_line()
        listen_host = f"[{self.host}]" if ":" in self.host else self.host
        conf = self.run_dir / "nginx.conf"
        tls = ""
        if self.tls:
            tls = f"\n        ssl_certificate {self.tls[0]};\n        ssl_certificate_key {self.tls[1]};"
        listen = f"{listen_host}:{self.port}" + (" ssl" if self.tls else "")
        conf.write_text(CONF.format(user=user, workers=self.workers, run=self.run_dir, token=self.token,
                                    listen=listen, prefix=self.prefix, data=self.data, tls=tls))
        conf.chmod(0o600)  # it holds the token
        return conf

    def start(self, timeout_s: float = 15.0) -> "NginxStore":
        if self._process and self._process.alive():
            return self
        self._process = start_nginx("nginx", self.run_dir, self._write_config(), self.host, [self.port], self.wrap,
                                    timeout_s)
        return self

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()

    def __enter__(self) -> "NginxStore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

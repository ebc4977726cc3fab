"""In-process store for tests: ``memory://NAME`` (stores of the same name share contents)."""
from __future__ import annotations

import threading
import time
from typing import Dict, Iterator, Optional
from urllib.parse import urlsplit

from . import Entry, KVStore, check_key

_SPACES: Dict[str, Dict[str, bytes]] = {}
_LOCK = threading.Lock()


class MemoryStore(KVStore):
    def __init__(self, name: str = "default") -> None:
        self.url = f"memory://{name}"
        with _LOCK:
            self._data = _SPACES.setdefault(name, {})

    @classmethod
    def from_url(cls, url: str) -> "MemoryStore":
        return cls(urlsplit(url).netloc or "default")

    def get(self, key: str) -> Optional[bytes]:
        return self._data.get(check_key(key))

    def exists(self, key: str) -> bool:
        return check_key(key) in self._data

    def put(self, key: str, data: bytes, overwrite: bool = False) -> bool:
        key, value = check_key(key), bytes(data)
        with _LOCK:
            if not overwrite and key in self._data:
                return False
            self._data[key] = value
            return True

    def delete(self, key: str) -> None:
        self._data.pop(check_key(key), None)

    def scan(self) -> Iterator[Entry]:
        """Every stored chunk; ``time`` is now (memory keeps no times)."""
        now = time.time()
        for key, value in list(self._data.items()):
            yield Entry(key, len(value), now)

"""The error of the link tooling."""
from __future__ import annotations

from kvcodec.errors import KVCodecError


class LinkError(KVCodecError, OSError):
    """A link cannot be set up, used or torn down; the message says which command failed."""

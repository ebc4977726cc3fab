"""Error hierarchy of the library.

Each error also subclasses the built-in that describes it (as PyAV's InvalidDataError is also a
ValueError), so callers that do not know this module still catch it sensibly. The Triton edge maps
them to response codes in one place (``kvcodec.triton.error_for``):

- ``BadRequest``        -> INVALID_ARG   (the client sent something malformed; only this error)
- ``StoreUnavailable``  -> UNAVAILABLE   (the store cannot be reached)
- ``Unsupported``       -> UNSUPPORTED   (a decoder or codec is not available on this machine)
- anything else         -> INTERNAL      (a short message; the traceback stays in the server log)

``CorruptChunk`` and ``ForeignChunk`` never reach a client: the fetcher turns them into a miss
from that chunk on, and the model computes the rest.
"""
from __future__ import annotations


class KVCodecError(Exception):
    """Base of every error raised by kvcodec."""


class ConfigError(KVCodecError, ValueError):
    """A setting has a bad value; the message names the field and the value."""


class BadRequest(KVCodecError, ValueError):
    """A request is malformed (wrong dtype, shape, empty prompt...)."""


class ChunkError(KVCodecError, ValueError):
    """A stored chunk cannot be used."""


class CorruptChunk(ChunkError):
    """A chunk fails its checksum, its header or its decode."""


class ForeignChunk(ChunkError):
    """A chunk was written for another model, codec, layout or key."""


class StoreUnavailable(KVCodecError, ConnectionError):
    """The store cannot be reached or refused the operation."""


class StoreTimeout(StoreUnavailable):
    """The store did not answer within the request's fetch deadline."""


class DecoderCrashed(KVCodecError, RuntimeError):
    """The decoder's process died while decoding a chunk (``bitstream.isolated``): a miss."""


class DecodeTimeout(KVCodecError, TimeoutError):
    """The decoder did not finish a chunk within its deadline (``bitstream.isolated``): a miss."""


class Unsupported(KVCodecError, NotImplementedError):
    """A codec, decoder or store backend is not available here."""

"""Step ``kv_decode``: chunk bytes -> verified, typed planes and the restore descriptor.

``ChunkDecoder.decode(data, key)`` parses the container (zero-copy: sections are views of
``data``) and verifies its authentication tag (``format.auth``), checks model and key, reads the header once into a ``ChunkHeader``, decodes the
payload with the scheme's bitstream coder (one coder object per scheme, made on first use) and
checks the planes against the digest taken at ingest (hashed from the array's buffer). It raises
``CorruptChunk`` (checksum, header, bitstream, digest) or ``ForeignChunk`` (not signed with this
deployment's key, another model, key, or a codec identity this build does not read).

``DecodeStep.run(info, data)`` is the step's whole job: it never raises for a bad chunk; it marks
the ``ChunkInfo`` failed (a miss from that chunk on) and returns empty planes.

The contract with ``kv_restore`` is ``Decoded``: planes as ``uint8`` or ``uint16``
``[frames, height, width]`` (their real dtype and shape), the checked ``ChunkHeader`` and the
side sections (small: scales, steps, token order). Nothing is re-serialized or re-verified.

Self-tested decoders (``selftest=True``, or ``device_output=True``; kv_decode's): the HEVC decoder
is made once with the GPU id and output mode given, and checked at start-up on the reference
stream of every stream profile the rungs write (``bitstream.selftest``, ``bitstream.verified``; ``selftest_results``
says how each fared). A decoder is not used for a profile it failed: ``decoder="auto"`` falls
back to PyAV, any other name makes that profile's chunks misses (``Unsupported``, with the
reason). Planes a verified decoder leaves on the device (NVDEC ``device_output``: torch tensors on
the GPU) skip the per-chunk host digest: the bitstream itself is still covered by the container's
payload digest and the keyed tag, checked on the bytes before decoding, and the decoder by its
self-test. Only the first chunk of each (profile, planes shape) is still hashed on the host (one
copy): the self-test's streams have one frame size, and NVDEC reconfigures per size. Host planes
(PyAV, NVDEC's host mode) and profiles with no reference stream keep the digest check. Without
``selftest``, each scheme's coder makes its own decoder.

Entropy-coded rungs (``zstd`` payloads: int8-zstd, kvtc-w, ...) decode with the entropy decoder
named by ``entropy`` (``bitstream.decoders.ENTROPY_DECODERS``: ``cpu``, the default; ``nvcomp`` on a
GPU, planes as a tensor on it; ``auto``: nvCOMP where it opens), made once; a named decoder that
cannot be made raises ``Unsupported`` here, at start-up. A decoder whose planes stay on the device
is self-tested then too (``bitstream.entropy_selftest``: one reference payload per zstd framing)
and trusted as NVDEC is: its planes are hashed on the host only for the first chunk of each
(framing, planes shape). ``auto`` whose nvCOMP fails a framing falls back to the CPU decoder; a
named ``nvcomp`` that fails one makes that framing's chunks misses (``Unsupported``, with the
reason). Host planes (the CPU decoder) are always checked against the digest.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Set, Tuple

import numpy as np

from ..bitstream import BitstreamCoder, entropy_selftest
from ..bitstream.decoders import open_entropy_decoder
from ..bitstream.entropy_selftest import framing_of
from ..bitstream.host import host_array
from ..bitstream.stream_profiles import STREAM_PROFILES, stream_profile
from ..bitstream.verified import VerifiedDecoders
from ..encode import PAYLOAD, make_coder, planes_digest
from ..errors import ChunkError, CorruptChunk, DecodeTimeout, ForeignChunk, KVCodecError, Unsupported
from ..format import container
from ..format.auth import PREVIOUS, ChunkAuth
from ..format.codecs import SCHEMES
from ..format.geometry import Geometry
from ..format.header import ChunkHeader
from .chunkinfo import ChunkInfo

log = logging.getLogger(__name__)


@dataclass
class Decoded:
    header: Optional[ChunkHeader]  # None for a failed or empty chunk
    planes: Any  # uint8 or uint16 [frames, height, width]: numpy, or a torch tensor on the decoder's GPU
    side: Dict[str, bytes] = field(default_factory=dict)  # the chunk's sections but the payload
    signer: str = ""  # the key that verified the chunk: current or previous (format.auth)

    @classmethod
    def empty(cls) -> "Decoded":
        return cls(None, np.zeros((0, 0, 0), np.uint8), {})


def status_of(exc: Exception) -> str:
    if isinstance(exc, DecodeTimeout):
        return "timeout"
    return "foreign" if isinstance(exc, ForeignChunk) else "corrupt" if isinstance(exc, ChunkError) else "error"


class ChunkDecoder:
    """Decodes chunks of any registered scheme that ``auth``'s key signed; one coder object per
    scheme, made on first use."""

    def __init__(self, model_id: str, *, auth: ChunkAuth, decoder: str = "pyav", threads: int = 1,
                 geometry: Optional[Geometry] = None, selftest: bool = False, gpu_id: int = 0,
                 device_output: bool = False, isolate: bool = False, decode_timeout_s: float = 30.0,
                 entropy: str = "cpu") -> None:
        """``geometry``: the KV geometry of one chunk of this model (its card's, at the chunk size);
        a chunk of another geometry is foreign, refused before anything is allocated for it.
        ``selftest``: one HEVC decoder, self-tested now (see the module's docstring); ``gpu_id``
        and ``device_output`` (which implies ``selftest``) are NVDEC's; ``isolate`` and
        ``decode_timeout_s``: the self-tested PyAV decoder runs in a process of its own, each chunk
        within the deadline (``bitstream.isolated``); ``entropy``: the zstd payloads' decoder (above)."""
        self.model_id = model_id
        self.auth = auth
        self.geometry = geometry
        self._runtime = {"decoder": decoder, "threads": threads}
        self._codecs: Dict[str, BitstreamCoder] = {}
        self._entropy = None if entropy == "cpu" else open_entropy_decoder(entropy, gpu_id=gpu_id)  # first: may raise
        self._entropy_results: Optional[Dict[str, Any]] = None  # per framing, a device decoder's self-test
        self._entropy_fallback: Dict[str, Any] = {}  # an ``auto`` nvCOMP that failed it: its results
        if getattr(self._entropy, "device_output", False):
            self._entropy_results = entropy_selftest.verify(self._entropy)
            if entropy == "auto" and not all(r["ok"] for r in self._entropy_results.values()):
                log.warning("entropy decoder %s failed its self-test, the CPU's is used: %s", self._entropy.name,
                            self._entropy_results)
                self._entropy_fallback = {self._entropy.name: self._entropy_results}
                self._entropy.close()
                self._entropy, self._entropy_results = None, None
        self._video: Optional[VerifiedDecoders] = None
        if selftest or device_output:
            self._video = VerifiedDecoders(decoder, threads=threads, gpu_id=gpu_id, device_output=device_output,
                                           isolate=isolate, timeout_s=decode_timeout_s)
        self._trusted: Set[Tuple[str, Tuple[int, ...]]] = set()  # (profile, shape) checked once on the host

    @property
    def selftest_results(self) -> Optional[Dict[str, Any]]:
        """Per decoder and stream profile (or zstd framing), how its start-up self-test went (None
        without one)."""
        out = {} if self._video is None else self._video.summary()
        tested = dict(self._entropy_fallback)
        if self._entropy_results is not None:
            tested[self._entropy.name] = self._entropy_results
        for name, results in tested.items():
            out[name] = {p: r["detail"] if r["ok"] else f"{r['status']}: {r['detail']}" for p, r in results.items()}
        return out if (self._video is not None or tested) else None

    @property
    def verified_stream_profiles(self) -> Set[str]:
        return set() if self._video is None else self._video.verified_stream_profiles

    @property
    def selftest_passed(self) -> bool:
        """Every self-test run here passed: the HEVC decoder on every stream profile, a device
        entropy decoder on every zstd framing (and ``auto`` did not fall back from it)."""
        video = self._video is None or self._video.verified_stream_profiles == set(STREAM_PROFILES)
        entropy = not self._entropy_fallback and (
            self._entropy_results is None or self.verified_framings == set(entropy_selftest.FRAMINGS))
        return video and entropy

    @property
    def verified_framings(self) -> Set[str]:
        """The zstd framings the device entropy decoder passed its self-test on (none without one)."""
        return {f for f, r in (self._entropy_results or {}).items() if r["ok"]}

    def _codec_for(self, header: ChunkHeader) -> BitstreamCoder:
        identity = header.scheme_id
        if identity not in self._codecs:
            base = SCHEMES.get(header.scheme)
            if base is None:
                raise ForeignChunk(f"chunk codec {identity!r} is not one this build reads")
            scheme = replace(base, codec_params=header.codec_params, layout_params=header.layout_params)
            if scheme.identity != identity:
                raise ForeignChunk(f"chunk codec {identity!r} is not one this build reads")
            try:
                self._codecs[identity] = make_coder(scheme, **self._runtime)
            except (TypeError, ValueError, OverflowError) as exc:
                raise ForeignChunk(f"chunk codec settings {header.codec_params!r} not understood: {exc}"[:300]) from None
        return self._codecs[identity]

    def decode(self, data: Any, key: Optional[str] = None) -> Decoded:
        chunk = container.parse(data, self.auth)
        chunk.expect(model_id=self.model_id)
        if key is not None:
            chunk.expect(key=key)
        for name in ("scheme_id", "codec_params"):  # a codec this build cannot name is foreign, not corrupt
            if not isinstance(chunk.header.get(name), (str if name == "scheme_id" else dict)):
                raise ForeignChunk(f"chunk codec {chunk.header.get('scheme_id')!r} is not one this build reads")
        if PAYLOAD not in chunk.sections:
            raise CorruptChunk("chunk has no payload")
        header = ChunkHeader.from_dict(chunk.header)
        if self.geometry is not None and header.geometry != self.geometry:
            raise ForeignChunk(f"chunk geometry {header.geometry.to_dict()} is not this model's "
                               f"{self.geometry.to_dict()}")
        coder = self._codec_for(header)
        trust = None  # (profile, shape) of planes a verified decoder left on the device
        if self._video is not None and coder.name == "hevc":
            planes, trust = self._decode_video(coder, header, chunk.sections[PAYLOAD])
        elif self._entropy is not None and coder.name == "zstd":
            planes, trust = self._decode_entropy(coder, header, chunk.sections[PAYLOAD])
        else:
            planes = coder.decode(chunk.sections[PAYLOAD], header.planes_shape)
        if _dtype_name(planes) != header.planes_dtype.name or tuple(planes.shape) != tuple(header.planes_shape):
            raise CorruptChunk(f"decoder returned {_dtype_name(planes)}{tuple(planes.shape)}, the header says "
                               f"{header.planes_dtype}{header.planes_shape}")
        if trust is None or trust not in self._trusted:
            # Planes that are the payload's bytes have the digest the container check just verified:
            # comparing the two strings is the same check as hashing the planes a second time.
            digest = chunk.digests.get(PAYLOAD) if coder.verbatim else planes_digest(host_array(planes))
            if digest != header.planes_digest:
                raise CorruptChunk("decoded planes do not match the digest taken at ingest")
            if trust is not None:
                self._trusted.add(trust)
        side = {name: bytes(body) for name, body in chunk.sections.items() if name != PAYLOAD}
        return Decoded(header, planes, side, chunk.signer)

    def _decode_video(self, coder: Any, header: ChunkHeader, payload: Any) -> Tuple[Any, Optional[tuple]]:
        """An HEVC payload through the self-tested decoder for its stream profile: (planes, the
        (profile, shape) key when they are a verified decoder's device output, else None)."""
        profile = stream_profile(header.codec_params)
        decoder, verified = self._video.choose(profile)
        planes = coder.decode_with(decoder, payload, header.planes_shape)  # untiled where the stream is tiled
        if isinstance(planes, np.ndarray):
            return planes, None
        device = verified and bool(getattr(decoder, "device_output", False))
        return planes, (profile, coder.stream_shape(header.planes_shape)) if device else None

    def _decode_entropy(self, coder: Any, header: ChunkHeader, payload: Any) -> Tuple[Any, Optional[tuple]]:
        """A zstd payload through the entropy decoder: (planes, the (framing, shape) key when they are
        a self-tested decoder's device output, else None)."""
        framing = framing_of(header.codec_params)
        result = None if self._entropy_results is None else self._entropy_results.get(framing)
        if result is not None and not result["ok"]:
            raise Unsupported(f"entropy decoder {self._entropy.name} failed its self-test for {framing}: "
                              f"{result['status']}: {result['detail']}"[:300])
        planes = coder.decode_with(self._entropy, payload, header.planes_shape)
        if isinstance(planes, np.ndarray) or result is None:
            return planes, None
        return planes, ("entropy:" + framing, tuple(int(v) for v in header.planes_shape))

    def close(self) -> None:
        for codec in self._codecs.values():
            codec.close()
        self._codecs.clear()
        if self._video is not None:
            self._video.close()
        if self._entropy is not None:
            self._entropy.close()


def _dtype_name(planes: Any) -> str:
    """numpy's name of the planes' dtype (``uint16``), for torch tensors too."""
    return planes.dtype.name if isinstance(planes, np.ndarray) else str(planes.dtype).replace("torch.", "")


class DecodeStep:
    """Bitstream -> planes. Holds one decoder per codec, made once."""

    def __init__(self, model_id: str, *, auth: ChunkAuth, decoder: str = "pyav", threads: int = 1,
                 geometry: Optional[Geometry] = None, resign: Optional[Callable[[str, bytes], Any]] = None,
                 **options: Any) -> None:
        """``options``: ``ChunkDecoder``'s ``selftest``, ``gpu_id``, ``device_output``, ``isolate``,
        ``decode_timeout_s``. ``resign(key, data)``: handed each chunk a previous key verified
        (``serving.resign.ReSigner.offer``: signed again with the current key, off the request's path)."""
        self.resign = resign
        self.decoder = ChunkDecoder(model_id, auth=auth, decoder=decoder, threads=threads, geometry=geometry,
                                    **options)

    def run(self, info: ChunkInfo, data: Any) -> Decoded:
        """``data``: the chunk's bytes (any buffer: bytes, a numpy array). Marks ``info``."""
        info.t["received"] = time.time()
        if not info.ok or not len(data):
            return Decoded.empty()
        t0 = time.perf_counter()
        try:
            out = self.decoder.decode(data, key=info.key or None)
        except (KVCodecError, ValueError) as exc:
            if not isinstance(exc, KVCodecError):
                log.exception("unexpected decode failure")
            info.fail(status_of(exc), f"decode: {exc}")
            out = Decoded.empty()
        info.s["decode"] = time.perf_counter() - t0
        info.t["decoded"] = time.time()
        info.signer = out.signer
        if out.signer == PREVIOUS and self.resign is not None and info.key:
            self.resign(info.key, bytes(data))
        return out

    def close(self) -> None:
        self.decoder.close()

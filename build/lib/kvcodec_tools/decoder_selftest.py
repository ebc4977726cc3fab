"""``python -m kvcodec_tools.decoder_selftest``: the decoder self-test from the command line, and the
reference streams made again.

- ``[--decoder nvdec|pyav|auto] [--gpu-id N] [--device-output]`` self-tests that decoder
  (``kvcodec.bitstream.verified.VerifiedDecoders``) and prints each profile's result; exit 1 unless
  every profile passed.
- ``--regenerate [--directory D]`` encodes every profile's reference stream with the project's
  encoder (``hevc.Hevc``, the profile's rung settings, tiled where the rung tiles) and writes it with
  its digests to ``kvcodec/bitstream/reference/`` (needs PyAV and x265), and the entropy framings'
  reference zstd payloads (``entropy_selftest``; needs zstandard): after a change to a video rung's
  settings, ``tests/unit/test_decoder_selftest.py`` says when.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import numpy as np

from kvcodec.bitstream import entropy_selftest, selftest
from kvcodec.bitstream.stream_profiles import STREAM_PROFILES, profile_params


def regenerate(directory: Path = selftest.REFERENCE_DIR, log=print) -> Dict[str, Any]:
    """Encode every profile's reference stream and write it with its digests to ``directory``."""
    import av

    from kvcodec.bitstream.hevc import Hevc, PyAVDecoder

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index: Dict[str, Any] = {"format": selftest.FORMAT, "made_with": {"av": av.__version__}, "profiles": {}}
    for name in STREAM_PROFILES:
        params = profile_params(name)
        coder = Hevc(**params)
        planes = selftest.reference_planes(coder.bit_depth)
        data = coder.encode(planes)
        frames, height, width = coder.stream_shape(planes.shape)
        decoded = np.stack(PyAVDecoder().decode(data, width, height, coder.bit_depth))
        if decoded.shape != (frames, height, width):
            raise RuntimeError(f"{name}: the reference stream decodes to {decoded.shape}, not {(frames, height, width)}")
        if coder.lossless and not np.array_equal(coder.decode(data, planes.shape), planes):
            raise RuntimeError(f"{name}: the lossless reference stream does not decode to its planes")
        (directory / f"{name}.hevc").write_bytes(data)
        index["profiles"][name] = {
            "file": f"{name}.hevc", "codec_params": params, "bit_depth": coder.bit_depth,
            "shape": list(decoded.shape), "planes_shape": list(planes.shape), "dtype": decoded.dtype.name,
            "bytes": len(data), "stream_sha256": hashlib.sha256(data).hexdigest(),
            "planes_digest": selftest._digest(decoded)}
        log(f"{name}: {len(data)} bytes, {decoded.dtype.name}{list(decoded.shape)} from planes {list(planes.shape)}")
    (directory / selftest.INDEX).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    regenerate_entropy(directory, log)
    return index


def regenerate_entropy(directory: Path = selftest.REFERENCE_DIR, log=print) -> Dict[str, Any]:
    """Encode each framing's reference payload (python-zstandard) and write it with the
    digest of its CPU decode (``entropy_selftest``)."""
    import zstandard

    from kvcodec.bitstream.simple import Zstd, ZstdCpuDecoder

    directory = Path(directory)
    index: Dict[str, Any] = {"format": entropy_selftest.FORMAT, "made_with": {"zstandard": zstandard.__version__},
                             "profiles": {}}
    planes = entropy_selftest.reference_planes()
    for name in entropy_selftest.FRAMINGS:
        params = dict(entropy_selftest.PARAMS[name])
        coder = Zstd(**params)
        data = coder.encode(planes)
        decoded = coder.decode_with(ZstdCpuDecoder(), data, planes.shape)
        if not np.array_equal(decoded, planes):
            raise RuntimeError(f"{name}: the reference payload does not decode to its planes")
        file, frames = f"{name}.zst", len(coder.frames(data))
        (directory / file).write_bytes(data)
        index["profiles"][name] = {
            "file": file, "codec_params": params, "planes_shape": list(planes.shape), "dtype": "uint8",
            "frames": frames, "bytes": len(data), "payload_sha256": hashlib.sha256(data).hexdigest(),
            "planes_digest": selftest._digest(decoded)}
        log(f"{name}: {len(data)} bytes in {frames} zstd frame(s), uint8{list(planes.shape)}")
    (directory / entropy_selftest.INDEX).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvcodec.bitstream.verified import VerifiedDecoders

    ap = argparse.ArgumentParser(prog="python -m kvcodec_tools.decoder_selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--regenerate", action="store_true",
                    help=f"encode the reference streams again into --directory (default {selftest.REFERENCE_DIR})")
    ap.add_argument("--directory", type=Path, default=selftest.REFERENCE_DIR)
    ap.add_argument("--decoder", default="pyav", help="decoder to self-test: pyav, nvdec, auto (default pyav)")
    ap.add_argument("--gpu-id", type=int, default=0)
    ap.add_argument("--device-output", action="store_true", help="NVDEC output kept in device memory")
    args = ap.parse_args(argv)
    if args.regenerate:
        regenerate(args.directory)
        return 0
    decoders = VerifiedDecoders(args.decoder, gpu_id=args.gpu_id, device_output=args.device_output,
                                directory=args.directory)
    try:
        print(json.dumps(decoders.summary(), indent=1))
        return 0 if decoders.verified_stream_profiles == set(STREAM_PROFILES) else 1
    finally:
        decoders.close()


if __name__ == "__main__":
    sys.exit(main())

"""Named KV codecs ("schemes"): a layout plus a bitstream codec with its settings.

These are the names users pass as ``--codec``. A scheme's ``identity`` names everything that
shapes the stored bytes (scheme, layout and their versions, codec settings); it is bound into
every chunk key and header, so changing any of it makes old chunks misses, never wrong reads.

- ``lossless8``: per-channel 8-bit quantization, HEVC lossless (the 8-bit values come back
  bit-exactly, through NVDEC or software);
- ``video``: the KVCodec video rung: the ``transform-zstd`` coefficients (below), each component
  scaled by its sensitivity weight (the codec profile's: bits where the model looks), as 10-bit
  luma, the tokens of each chunk chained nearest-neighbour first, the context's first 4 tokens
  exact, lossy HEVC Main10 intra at a constant QP (``quality`` sets the QP), x265 ``medium``
  without psycho-visual tuning;
- ``video-q8``: the 8-bit per-channel layout of ``lossless8``, lossy HEVC at a constant QP (the
  naive layout, kept as the baseline the layout research started from);
- ``int8-zstd``: the same 8-bit layout, zstd instead of video;
- ``raw``: the engine's own KV bytes, no compression (the first baseline): layout ``native`` in the
  model card's ``kv_dtype`` (float32 on CPU engines, 2x the float16 bytes; float16 on GPU), so
  reuse restores the engine's KV bit for bit and gives the tokens of its own full prefill;
- ``nlevel-zstd``: per-channel N-level quantization + zstd (``quality`` = N levels);
- ``transform-zstd``: keys before RoPE and values projected on the model's PCA basis (shipped in
  its codec profile), one uniform step per (layer, K|V), zstd (``quality`` = the step, in
  thousandths of the layer's RMS: lower is finer; the default 160 is the coarsest measured step
  that passes the quality gate on the eval set, ``perf/results/rd.json``);
- ``cachegen``: CacheGen-style per-token max-abs quantization with LMCache's per-layer bins, ANS
  entropy coding with per-(layer, channel) distributions (``quality`` = bins of the first layers);
- ``kvtc``: KVTC-style (NVIDIA, arXiv 2511.01815): the PCA coefficients with 0-6 bits per
  component by reverse water-filling on the fitted variances, the context's first 4 tokens exact,
  zstd (``quality`` = hundredths of a bit per coefficient); ``kvtc-w``: the same bits allocated on
  the variances times the sensitivity weights;
- ``video-fast``: the ``video`` rung's layout and QP with x265's faster coding tools (16x16 CTUs
  and transforms, no SAO): its own bitstreams, for contexts that must become reusable sooner.

Layout parameters (``layout_params``), where a scheme has them, are part of the identity too.
Two of them come from the model, not the table: the codec ``profile`` (PCA layouts) and the KV
``dtype`` (``raw``). ``Scheme.for_card(card)`` binds both from the engine's model card; every
caller that makes keys or chunks (ingest, the CLI, the fetcher, the quality harness, chunkbench)
binds through it (``format.ladder.parse_rung(spec, card)``), so all of them name the same identity.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional

from ..errors import ConfigError


@dataclass(frozen=True)
class Scheme:
    name: str
    layout: str
    codec: str
    codec_params: Dict[str, Any] = field(default_factory=dict)
    version: int = 1
    quality_param: Optional[str] = None  # the codec parameter that ``quality`` sets, if any
    layout_params: Dict[str, Any] = field(default_factory=dict)
    quality_in: str = "codec"  # "layout": ``quality`` sets a layout parameter instead
    baseline_only: bool = False  # measured against, not stored by default (not in the identity)

    @property
    def needs_profile(self) -> bool:
        """Whether the layout projects on a per-model codec profile (the model card names it)."""
        return self.layout in PROFILE_LAYOUTS

    @property
    def needs_kv_dtype(self) -> bool:
        """Whether the layout stores the engine's KV in its own dtype (the model card names it)."""
        return self.layout in KV_DTYPE_LAYOUTS

    def with_profile(self, profile: Optional[str]) -> "Scheme":
        """This scheme bound to the model's codec profile (itself if its layout needs none).

        The profile is a layout parameter, so it is part of the identity, the keys and the header."""
        if not self.needs_profile or profile is None:
            return self
        return replace(self, layout_params=dict(self.layout_params, profile=str(profile)))

    def with_kv_dtype(self, kv_dtype: Optional[str]) -> "Scheme":
        """This scheme bound to the engine's KV dtype (itself if its layout stores none): the
        ``dtype`` layout parameter, so part of the identity, the keys and the header too."""
        if not self.needs_kv_dtype or kv_dtype is None:
            return self
        return replace(self, layout_params=dict(self.layout_params, dtype=str(kv_dtype)))

    def for_card(self, card: Any) -> "Scheme":
        """This scheme bound to a model: its card's ``codec_profile`` and ``kv_dtype``
        (``engines.ModelCard``). The one binding every key-making caller uses."""
        return self.with_profile(card.codec_profile).with_kv_dtype(card.kv_dtype)

    @property
    def identity(self) -> str:
        params = json.dumps(self.codec_params, sort_keys=True, separators=(",", ":"))
        layout = self.layout
        if self.layout_params:
            layout += json.dumps(self.layout_params, sort_keys=True, separators=(",", ":"))
        return f"{self.name}/v{self.version}/{layout}/{self.codec}{params}"


PROFILE_LAYOUTS = frozenset({"pca", "pca10", "kvtc"})
KV_DTYPE_LAYOUTS = frozenset({"native"})
BOUND_PARAMS = ("profile", "dtype")  # layout parameters bound from the model card, not set by quality

SCHEMES: Dict[str, Scheme] = {
    "lossless8": Scheme("lossless8", layout="q8", codec="hevc", codec_params={"lossless": True, "qp": 0, "preset": "ultrafast"},
                        version=2),
    # v4: bits where the model looks (the profile's sensitivity weights scale each component before
    # the codec's one QP) and the context's first 4 tokens (attention sinks) kept exact; QP 13, the
    # coarsest measured that passes the gate on the eval set (perf/results/rd-bits.json: 5.90x)
    "video": Scheme("video", layout="pca10", codec="hevc",
                    codec_params={"lossless": False, "qp": 13, "preset": "medium", "bit_depth": 10, "tune": "mse"},
                    layout_params={"step": 40, "reorder": 1, "weighted": 1, "sink": 4},
                    quality_param="qp", version=4),
    # the video rung with x265's faster coding tools (16x16 CTUs and transforms, no SAO, no SEI):
    # encodes in ~0.75x the CPU time at +0.2% bytes at equal QP (perf/results/README.md, "Encode speed")
    "video-fast": Scheme("video-fast", layout="pca10", codec="hevc",
                         codec_params={"lossless": False, "qp": 13, "preset": "medium", "bit_depth": 10, "tune": "mse",
                                       "x265": "ctu=16:max-tu-size=16:sao=0:info=0"},
                         layout_params={"step": 40, "reorder": 1, "weighted": 1, "sink": 4},
                         quality_param="qp"),
    # the video rung's planes tiled into few large frames for NVDEC (``bitstream.tiling``: a
    # 256-token SmolLM2 chunk is one 1536x1920 frame instead of 60 of 256x192), with x265's
    # rate-distortion-optimised quantization and transform skip: at QP 13 on these planes -0.4%
    # bytes and -3.8% squared error against one frame per plane (perf/results/tiling.json, planes_probe)
    "video-tiled": Scheme("video-tiled", layout="pca10", codec="hevc",
                          codec_params={"lossless": False, "qp": 13, "preset": "medium", "bit_depth": 10, "tune": "mse",
                                        "tile": 4, "x265": "rdoq-level=1:tskip=1"},
                          layout_params={"step": 40, "reorder": 1, "weighted": 1, "sink": 4},
                          quality_param="qp"),
    "video-q8": Scheme("video-q8", layout="q8", codec="hevc",
                       codec_params={"lossless": False, "qp": 8, "preset": "ultrafast"}, quality_param="qp", version=2,
                       baseline_only=True),
    "int8-zstd": Scheme("int8-zstd", layout="q8", codec="zstd", codec_params={"level": 3}, quality_param="level"),
    # v2: the engine's own dtype (v1 was always float16; its chunks are misses now, never wrong reads).
    # The table's float16 is for an unbound scheme; ``for_card`` sets the engine's.
    "raw": Scheme("raw", layout="native", codec="identity", layout_params={"dtype": "float16"}, version=2),
    "nlevel-zstd": Scheme("nlevel-zstd", layout="qn", codec="zstd", codec_params={"level": 19},
                          layout_params={"levels": 32}, quality_param="levels", quality_in="layout"),
    "transform-zstd": Scheme("transform-zstd", layout="pca", codec="zstd", codec_params={"level": 19},
                             layout_params={"step": 160, "kv_balance": 2},
                             quality_param="step",
                             quality_in="layout"),
    "cachegen": Scheme("cachegen", layout="cg", codec="ans", layout_params={"bins": 32}, quality_param="bins",
                       quality_in="layout"),
    # KVTC as published (bits allocated on the fitted variances), the baseline; kvtc-w spends them
    # where the model looks (the profile's sensitivity weights)
    "kvtc": Scheme("kvtc", layout="kvtc", codec="zstd", codec_params={"level": 19},
                   layout_params={"bits": 350, "sink": 4, "recent": 0}, quality_param="bits", quality_in="layout",
                   baseline_only=True),
    "kvtc-w": Scheme("kvtc-w", layout="kvtc", codec="zstd", codec_params={"level": 19},
                     layout_params={"bits": 350, "sink": 4, "recent": 0, "weighted": 1}, quality_param="bits",
                     quality_in="layout"),
}



def get_scheme(name: str, quality: Optional[int] = None, profile: Optional[str] = None,
               kv_dtype: Optional[str] = None) -> Scheme:
    """The scheme called ``name``, with its quality parameter set to ``quality`` if given, bound to
    the codec ``profile`` and the ``kv_dtype`` of the model where its layout needs them. Callers
    with a model card bind with ``get_scheme(name, quality).for_card(card)`` (or ``parse_rung``)."""
    if name not in SCHEMES:
        raise ConfigError(f"codec {name!r} is unknown (known: {', '.join(sorted(SCHEMES))})")
    scheme = SCHEMES[name].with_profile(profile).with_kv_dtype(kv_dtype)
    if quality is None:
        return scheme
    if scheme.quality_param is None:
        raise ConfigError(f"codec {name!r} has no quality setting (got quality={quality})")
    if scheme.quality_in == "layout":
        return replace(scheme, layout_params=dict(scheme.layout_params, **{scheme.quality_param: int(quality)}))
    params = dict(scheme.codec_params, **{scheme.quality_param: int(quality)})
    return replace(scheme, codec_params=params)

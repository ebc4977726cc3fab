"""Per-model codec profiles: the fixed transform a layout uses, fitted once per model offline.

A profile holds, per (layer, K|V), the mean and the PCA basis of the model's KV vectors (all KV
heads of one token side by side, ``kv_heads * head_dim`` values; keys taken before RoPE), and the
RMS of the centred data. It is fitted on texts outside the eval set (``kvcodec profile fit``) and
shipped with the package as ``<name>.npz``; ``KVCODEC_PROFILE_DIR`` adds a directory searched
first. A model folder's profile (``--model DIR``) is fitted by ``kvcodec profile fit --model DIR``
into the model cache: its card registers the file and the command (``register_model_profile``), and
until the file exists ``find_profile`` refuses the rungs that need it with a message naming that
command. A chunk names its profile in the layout parameters and carries the file's digest, so a
reader with a different file under the same name gets a foreign chunk, never wrong KV.

The basis is stored as float16 and used as the float16-rounded values on both sides (encode and
restore use the same numbers; the small loss of orthogonality is far below the quantization step).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

import numpy as np

from ..errors import ConfigError

HERE = Path(__file__).resolve().parent
_CACHE: Dict[str, "Profile"] = {}
_LOCK = threading.Lock()
_MODEL_PROFILES: Dict[str, Tuple[Path, str]] = {}  # name -> (its file, the command that fits it)


@dataclass(frozen=True)
class Profile:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    mean: np.ndarray  # float32 [layers, 2, C]
    basis: np.ndarray  # float32 [layers, 2, C, C]; column j = component j, by decreasing variance
    variance: np.ndarray  # float32 [layers, 2, C]: each component's variance on the fit set
    rms: np.ndarray  # float32 [layers, 2]: RMS of the centred data
    digest: str  # blake2b of the file
    # float32 [layers, 2, C] or None: how much an error on each component moves the model's output
    # (``kvcodec_tools.quality.sensitivity``; geometric mean 1); weighted layouts step by 1 / sqrt(weight)
    weight: Optional[np.ndarray] = None

    @property
    def channels(self) -> int:
        return self.kv_heads * self.head_dim

    def fits(self, layers: int, kv_heads: int, head_dim: int) -> bool:
        return (self.layers, self.kv_heads, self.head_dim) == (layers, kv_heads, head_dim)


def _search_dirs() -> Iterable[Path]:
    extra = os.environ.get("KVCODEC_PROFILE_DIR")
    if extra:
        yield Path(extra)
    yield HERE


def register_model_profile(name: str, path: Path, fit_command: str) -> None:
    """Where a model folder's profile ``name`` lives (fitted or not yet) and the command that fits it."""
    _check_name(name)
    _MODEL_PROFILES[name] = (Path(path), fit_command)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,63}", name):
        raise ConfigError(f"bad codec profile name {str(name)[:80]!r}")


def find_profile(name: str) -> Path:
    _check_name(name)
    for d in _search_dirs():
        path = d / f"{name}.npz"
        if path.is_file():
            return path
    if name in _MODEL_PROFILES:
        path, command = _MODEL_PROFILES[name]
        if path.is_file():
            return path
        from ..format.codecs import SCHEMES

        need = [n for n, s in SCHEMES.items() if s.needs_profile]
        free = [n for n, s in SCHEMES.items() if not s.needs_profile and not s.baseline_only]
        raise ConfigError(f"codec profile {name!r} of this model is not fitted yet (the rungs {', '.join(need)} "
                          f"need it): run `{command}`, or choose rungs that need none ({', '.join(free)})")
    raise ConfigError(f"codec profile {name!r} not found (looked in {', '.join(str(d) for d in _search_dirs())}); "
                      f"fit one with `kvcodec profile fit`")


def require_profiles(schemes) -> None:
    """Refuse (``find_profile``'s ``ConfigError``) the first of ``schemes`` (bound to a model card)
    whose codec profile does not exist: before any prefill or encoding is done."""
    for scheme in schemes:
        if scheme.needs_profile and scheme.layout_params.get("profile"):
            find_profile(str(scheme.layout_params["profile"]))


def load_profile(name: str) -> Profile:
    """The profile ``name`` (read once per process)."""
    with _LOCK:
        if name not in _CACHE:
            _CACHE[name] = read_profile(find_profile(name), name)
        return _CACHE[name]


def read_profile(path: Path, name: Optional[str] = None) -> Profile:
    data = Path(path).read_bytes()
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            basis = z["basis"].astype(np.float32)
            mean = z["mean"].astype(np.float32)
            variance = z["variance"].astype(np.float32)
            weight = z["weight"].astype(np.float32) if "weight" in z.files else None
    except (KeyError, ValueError, OSError) as exc:
        raise ConfigError(f"codec profile {path} is not readable: {exc}") from None
    L, H, D = int(meta["layers"]), int(meta["kv_heads"]), int(meta["head_dim"])
    C = H * D
    if basis.shape != (L, 2, C, C) or mean.shape != (L, 2, C) or variance.shape != (L, 2, C):
        raise ConfigError(f"codec profile {path} has inconsistent shapes")
    if weight is not None and (weight.shape != (L, 2, C) or not np.isfinite(weight).all() or weight.min() <= 0):
        raise ConfigError(f"codec profile {path} has weights that are not positive [layers, 2, C] numbers")
    rms = np.sqrt(np.maximum(variance.mean(axis=-1), 1e-12)).astype(np.float32)
    return Profile(name or Path(path).stem, L, H, D, float(meta["rope_theta"]), mean, basis, variance, rms,
                   hashlib.blake2b(data, digest_size=16).hexdigest(), weight)


def fit_profile(samples: Iterable[np.ndarray], rope_theta: float) -> Dict[str, np.ndarray]:
    """Fit means and PCA bases from KV chunks ``[layers, 2, kv_heads, tokens, head_dim]`` at
    positions given as ``(kv, token_start)`` pairs. Returns the arrays ``save_profile`` writes."""
    from .rope import unrope

    sums = sq = None
    n = 0
    geometry = None
    for kv, token_start in samples:
        x = np.asarray(kv, dtype=np.float64).copy()
        L, _, H, T, D = x.shape
        geometry = (L, H, D)
        x[:, 0] = unrope(x[:, 0], token_start, rope_theta)
        X = x.transpose(0, 1, 3, 2, 4).reshape(L, 2, T, H * D)
        if sums is None:
            sums = np.zeros((L, 2, H * D))
            sq = np.zeros((L, 2, H * D, H * D))
        sums += X.sum(axis=2)
        sq += np.einsum("lktc,lktd->lkcd", X, X)
        n += T
    if geometry is None:
        raise ConfigError("no KV to fit a profile on")
    mean = sums / n
    cov = sq / n - np.einsum("lkc,lkd->lkcd", mean, mean)
    values, vectors = np.linalg.eigh(cov)  # ascending
    values, vectors = values[..., ::-1], vectors[..., ::-1]
    # A sign convention so a refit on the same data gives the same basis.
    signs = np.take_along_axis(vectors, np.abs(vectors).argmax(axis=-2)[..., None, :], axis=-2)
    vectors = vectors * np.where(signs < 0, -1.0, 1.0)
    L, H, D = geometry
    meta = {"layers": L, "kv_heads": H, "head_dim": D, "rope_theta": float(rope_theta), "fit_tokens": n}
    return {"meta": np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8),
            "mean": mean.astype(np.float32), "basis": vectors.astype(np.float16),
            "variance": np.maximum(values, 0).astype(np.float32)}


def save_profile(arrays: Dict[str, np.ndarray], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return path

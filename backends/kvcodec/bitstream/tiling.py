"""Planes tiled into few large frames, for a hardware video decoder (``hevc``'s ``tile``).

A layout makes many small planes (``video``: 60 planes of 192 x 256 samples for a 256-token
SmolLM2 chunk, one per (layer, K|V)). One frame per plane leaves NVDEC idle on per-frame work;
tiled, the same samples are one or a few frames of a few Mpixel. ``Tiling.of(planes_shape,
max_mpx)`` fixes the arrangement from the planes' shape alone (so the reader derives it from the
chunk header, nothing more is stored):

- planes per frame ``n``: as many as fit in ``max_mpx`` Mpixel (2^20 samples; at least one), then
  spread evenly over the frames needed (60 planes, 4 Mpixel: one frame of 60; at 1 Mpixel: three
  frames of 20);
- a grid of ``rows x cols`` planes per frame, plane ``i`` of a frame at ``(i // cols, i % cols)``
  in the planes' order: the grid with the fewest empty slots, then the squarest, within NVDEC's
  largest HEVC picture (``MAX_SIDE`` 8192 on Hopper) where a single plane fits it;
- the frame is the grid, padded right and below to at least ``MIN_SIDE`` (144, NVDEC's smallest
  HEVC picture) and to a multiple of 8 (the encoder's alignment); empty slots and padding hold
  mid-grey (``fill``), which codes to almost nothing.

``tile(planes)`` -> frames (numpy) for the encoder; ``untile(frames)`` -> planes for numpy arrays
and for torch tensors on any device (the NVDEC device output): one reshape and transpose, a copy.
The planes' digest (``format.container.planes_digest``) is taken on the untiled planes, as before tiling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

MAX_SIDE = 8192  # NVDEC's largest HEVC picture side (Hopper: 8192 x 8192)
MIN_SIDE = 144  # NVDEC's smallest HEVC picture side
ALIGN = 8  # hevc.Hevc.encode takes multiples of 8
MPX = 1 << 20


def _up(value: int, step: int) -> int:
    return -(-value // step) * step


@dataclass(frozen=True)
class Tiling:
    planes: int  # planes in the chunk
    height: int  # of one plane
    width: int
    per_frame: int  # planes per frame (the last frame may hold fewer)
    rows: int  # grid of planes in a frame
    cols: int
    frame_height: int  # of one frame, padding included
    frame_width: int

    @classmethod
    def of(cls, planes_shape: Tuple[int, int, int], max_mpx: int) -> "Tiling":
        planes, height, width = (int(v) for v in planes_shape)
        if min(planes, height, width) <= 0 or int(max_mpx) <= 0:
            raise ValueError(f"cannot tile planes {tuple(planes_shape)} into frames of {max_mpx} Mpixel")
        fit = max(1, min(planes, int(max_mpx) * MPX // (height * width)))
        frames = -(-planes // fit)
        per_frame = -(-planes // frames)
        best = None
        for cols in range(1, per_frame + 1):
            rows = -(-per_frame // cols)
            fits = cols * width <= MAX_SIDE and rows * height <= MAX_SIDE
            if not fits and per_frame > 1:
                continue
            rank = (rows * cols - per_frame, abs(cols * width - rows * height), cols)
            if best is None or rank < best[0]:
                best = (rank, rows, cols)
        if best is None:  # several planes never fit side by side: one a frame, as untiled
            per_frame, rows, cols = 1, 1, 1
        else:
            _, rows, cols = best
        return cls(planes, height, width, per_frame, rows, cols,
                   _up(max(rows * height, MIN_SIDE), ALIGN), _up(max(cols * width, MIN_SIDE), ALIGN))

    @property
    def frames(self) -> int:
        return -(-self.planes // self.per_frame)

    @property
    def frame_shape(self) -> Tuple[int, int, int]:
        """The stream's ``(frames, height, width)``."""
        return (self.frames, self.frame_height, self.frame_width)

    def tile(self, planes: np.ndarray, fill: int) -> np.ndarray:
        """``planes`` ``[planes, height, width]`` as frames ``frame_shape``, ``fill`` where no plane is."""
        if tuple(planes.shape) != (self.planes, self.height, self.width):
            raise ValueError(f"planes are {tuple(planes.shape)}, this tiling is for "
                             f"{(self.planes, self.height, self.width)}")
        slots = self.frames * self.rows * self.cols
        grid = np.full((slots, self.height, self.width), fill, dtype=planes.dtype)
        # the planes of a frame fill its first ``per_frame`` slots (the rest, and the last frame's
        # unused ones, stay ``fill``)
        index = np.arange(self.planes)
        grid[(index // self.per_frame) * self.rows * self.cols + index % self.per_frame] = planes
        frames = np.full(self.frame_shape, fill, dtype=planes.dtype)
        body = grid.reshape(self.frames, self.rows, self.cols, self.height, self.width).transpose(0, 1, 3, 2, 4)
        frames[:, :self.rows * self.height, :self.cols * self.width] = body.reshape(
            self.frames, self.rows * self.height, self.cols * self.width)
        return frames

    def untile(self, frames: Any) -> Any:
        """The planes ``[planes, height, width]`` from decoded frames ``frame_shape`` (numpy, or a
        torch tensor on any device: the result is of the same kind, on the same device)."""
        if tuple(frames.shape) != self.frame_shape:
            raise ValueError(f"frames are {tuple(frames.shape)}, this tiling makes {self.frame_shape}")
        wide_torch = _is_torch(frames) and str(frames.dtype) == "torch.uint16"
        x = frames.view(_torch().int16) if wide_torch else frames  # torch's uint16 has few kernels
        x = x[:, :self.rows * self.height, :self.cols * self.width]
        x = x.reshape(self.frames, self.rows, self.height, self.cols, self.width)
        x = x.permute(0, 1, 3, 2, 4) if _is_torch(x) else x.transpose(0, 1, 3, 2, 4)
        x = x.reshape(self.frames, self.rows * self.cols, self.height, self.width)[:, :self.per_frame]
        x = x.reshape(self.frames * self.per_frame, self.height, self.width)[:self.planes]
        if _is_torch(x):
            x = x.contiguous()
            return x.view(_torch().uint16) if wide_torch else x
        return np.ascontiguousarray(x)

    def describe(self) -> str:
        return (f"{self.planes} planes of {self.width}x{self.height} in {self.frames} frame(s) of "
                f"{self.frame_width}x{self.frame_height} ({self.rows}x{self.cols} grid, "
                f"{self.frame_width * self.frame_height / 1e6:.2f} Mpixel)")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _torch():
    import torch

    return torch

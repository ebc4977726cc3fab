"""Restore in torch with a device argument (``Layout.from_planes_torch``, ``serving.restore.restore(decoded,
device)``) against a numpy restore of every layout kept here frozen as the reference (``REFERENCE``:
each layout's ``from_planes`` in numpy).

Bit-exact on the CPU for every layout but ``pca10``: the same float32 operations in the same order
(``pca`` and ``pca10`` already did their matrix product with torch; RoPE's tables are the same float64
angles rounded once). ``pca10`` folds the centre 512 into an offset ``mean - 512 * basis.sum(-1)``: numpy
sums pairwise, torch in its own vectorised order, so the offset (tens) may differ in its last float32
bits, which moves the KV it cancels to by up to ~2e-6 absolute and rounds about 0.5% of the float16
values one step the other way; the test bounds exactly that (``assert_restores_alike``). A ``cuda`` run
(skipped without a GPU) compares with the CPU's result: exact for ``q8``, ``qn``, ``cg`` and ``native``,
within a looser absolute bound for ``pca`` and ``pca10`` (cuBLAS's matrix product).
"""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import pytest
import torch

from kvcodec.encode import ChunkEncoder
from kvcodec.errors import CorruptChunk, ForeignChunk
from kvcodec.format.codecs import get_scheme
from kvcodec.format.geometry import Geometry
from kvcodec.layout import cachegen, get_layout, nlevel, quant, tensors, transform
from kvcodec.layout.allocation import allocation
from kvcodec.profiles.rope import rope
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.decode import ChunkDecoder, Decoded
from kvcodec.serving.restore import EMPTY_KV, RestoreStep, restore

from .conftest import AUTH, TINY_PROFILE, on_tiny_profile, structured_kv, synthetic_kv

CPU = torch.device("cpu")
FP16_STEP = 2.0 ** -10  # float16's relative step
OFFSET_ULPS = 1e-5  # a few float32 last bits of an offset of magnitude up to ~64 (pca10: measured 2.5e-6)
TOKEN_START = 4000  # crosses the first RoPE table (4096 positions): the table grows
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device visible to torch "
                              "(torch.cuda.is_available() is False here); the CPU tests cover the same code")


def on_gpu(test):
    """A GPU test: marked ``gpu`` (opt-in selection: ``-m gpu``), skipped saying why without CUDA."""
    return pytest.mark.gpu(_NO_CUDA(test))


# -- the numpy restore before the port (frozen) ----------------------------------------------------------
def _f16(side, name, shape):
    return np.frombuffer(side[name], dtype=np.float16).reshape(shape).astype(np.float32)


def ref_q8(layout, planes, side, g, **_):
    shape = (g.layers, 2, g.kv_heads, 1, g.head_dim)
    lo, step = _f16(side, "q8_min", shape), _f16(side, "q8_step", shape)
    q = planes.reshape(g.layers, 2, g.tokens, g.kv_heads, g.head_dim).transpose(0, 1, 3, 2, 4)
    return (q.astype(np.float32) * step + lo).astype(np.float16)


def ref_qn(layout, planes, side, g, **_):
    shape = (g.layers, 2, g.kv_heads, 1, g.head_dim)
    lo, step = _f16(side, "qn_min", shape), _f16(side, "qn_step", shape)
    q = planes.reshape(g.layers, 2, g.tokens, g.kv_heads, g.head_dim).transpose(0, 1, 3, 2, 4)
    return (q.astype(np.float32) * step + lo).astype(np.float16)


def ref_cg(layout, planes, side, g, **_):
    mx = _f16(side, "cg_max", (g.layers, 2, g.tokens, 1))
    c = layout.half_range(g.layers)[:, :, None, None].astype(np.float32)
    q = planes.reshape(g.layers, 2, g.tokens, -1).astype(np.float32)
    x = (q - c) * (mx / c)
    return x.reshape(g.layers, 2, g.tokens, g.kv_heads, g.head_dim).transpose(0, 1, 3, 2, 4).astype(np.float16)


def ref_native(layout, planes, side, g, **_):
    wire = np.dtype("<f2" if layout.dtype == "float16" else "<f4")
    kv = np.ascontiguousarray(planes).view(wire).reshape(g.layers, 2, g.tokens, g.kv_heads, g.head_dim)
    return kv.transpose(0, 1, 3, 2, 4).astype(np.dtype(layout.dtype))


def _ref_synthesize(basis, coeff, offset):
    b = torch.from_numpy(np.ascontiguousarray(basis, dtype=np.float32))
    c = torch.from_numpy(np.ascontiguousarray(coeff)).to(torch.float32)
    out = torch.matmul(b, c)
    out += torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32))[..., None]
    return out.numpy()


def _ref_restore_kv(q, basis, offset, p, g, token_start, layout=None, side=None):
    X = _ref_synthesize(basis, q, offset)
    x = X.reshape(g.layers, 2, g.kv_heads, g.head_dim, g.tokens).transpose(0, 1, 2, 4, 3)
    out = np.empty(g.shape, dtype=np.float16)
    out[:, 0] = rope(np.ascontiguousarray(x[:, 0]), token_start, p.rope_theta)
    out[:, 1] = x[:, 1]
    exact = layout.exact_tokens(token_start, g.tokens) if layout is not None else []
    if len(exact):  # sink / recent tokens, stored as float16
        out[:, :, :, exact] = np.frombuffer(side["pca_exact"], np.float16).reshape(
            g.layers, 2, g.kv_heads, len(exact), g.head_dim)
    return out


def ref_pca(layout, planes, side, g, token_start):
    p = layout.profile
    step = np.frombuffer(side["pca_step"], dtype=np.float32).reshape(g.layers, 2)
    half = g.layers * 2
    z = (planes[:half].astype(np.uint16) | (planes[half:].astype(np.uint16) << 8)).astype(np.int32)
    q = ((z >> 1) ^ -(z & 1)).reshape(g.layers, 2, p.channels, g.tokens)
    scale = step[:, :, None] * layout.factors(p)  # each component's step
    return _ref_restore_kv(q, p.basis * scale[:, :, None, :], p.mean, p, g, token_start, layout, side)


def ref_pca10(layout, planes, side, g, token_start):
    p = layout.profile
    step = np.frombuffer(side["pca_step"], dtype=np.float32).reshape(g.layers, 2)
    shift = np.frombuffer(side["pca_shift"], dtype=np.uint8).reshape(g.layers, 2, p.channels)
    scale = step[:, :, None] * layout.factors(p) * np.exp2(shift).astype(np.float32)
    q = planes.reshape(g.layers, 2, p.channels, g.tokens)
    if layout.reorder:
        order = np.frombuffer(side["pca_order"], dtype="<u2").astype(np.int64)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(g.tokens)
        q = q[..., inverse]
    basis = p.basis * scale[:, :, None, :]
    offset = p.mean - layout.CENTRE * basis.sum(axis=-1)
    return _ref_restore_kv(q, basis, offset, p, g, token_start, layout, side)


def ref_kvtc(layout, planes, side, g, token_start):
    p = layout.profile
    step = allocation(p, layout.bits, bool(layout.weighted)).step  # 0 for a component given no bits
    q = planes.reshape(g.layers, 2, p.channels, g.tokens).astype(np.float32)
    coeff = np.where(step[..., None] > 0, (q - 128 + 0.5) * step[..., None], 0.0)  # midrise levels
    return _ref_restore_kv(coeff, p.basis, p.mean, p, g, token_start, layout, side)


REFERENCE: Dict[str, Callable] = {"q8": ref_q8, "qn": ref_qn, "cg": ref_cg, "native": ref_native,
                                  "pca": ref_pca, "pca10": ref_pca10, "kvtc": ref_kvtc}
# case -> (layout, its parameters); the pca ones on the tests' tiny profile
CASES = {
    "q8": ("q8", {}),
    "qn": ("qn", {"levels": 48}),
    "cg": ("cg", {"bins": 32}),
    "native16": ("native", {"dtype": "float16"}),
    "native32": ("native", {"dtype": "float32"}),
    "pca": ("pca", {"profile": TINY_PROFILE, "step": 160}),
    "pca10": ("pca10", {"profile": TINY_PROFILE, "step": 40}),
    "pca10-reorder": ("pca10", {"profile": TINY_PROFILE, "step": 40, "reorder": 1}),
}
EXACT = {"q8", "qn", "cg", "native", "native16", "native32", "pca"}


@pytest.fixture(scope="module")
def chunks(tiny_profile):
    """case -> (layout, planes, side, geometry, {token_start}) for one chunk at TOKEN_START."""
    kv = structured_kv(21, token_start=TOKEN_START)
    kv[:, :, :, :, :8] += synthetic_kv(21)[:, :, :, :, :8]  # more than a few directions in some channels
    out = {}
    for case, (name, params) in CASES.items():
        layout = get_layout(name, **params)
        at = {"token_start": TOKEN_START} if layout.needs_positions else {}
        planes, side = layout.to_planes(kv, **at)
        out[case] = (layout, np.frombuffer(planes.tobytes(), planes.dtype).reshape(planes.shape), side,
                     Geometry.of(kv), at)  # read-only, as a decoder's planes are
    return out


def assert_restores_alike(case: str, got, want, absolute: float = OFFSET_ULPS, share: float = 0.98) -> None:
    got = got.cpu().numpy() if isinstance(got, torch.Tensor) else got
    assert got.dtype == want.dtype and got.shape == want.shape
    if case in EXACT:
        bits = np.uint16 if want.dtype == np.float16 else np.uint32
        assert np.array_equal(got.view(bits), want.view(bits)), f"{case}: not bit-exact"
        return
    a, b = got.astype(np.float64), want.astype(np.float64)
    # one float16 step of the larger value (a float32 result a bit off that rounds the other way), plus
    # OFFSET_ULPS: the offset is tens while the KV it cancels to may be near zero, so one last bit
    # of the offset (2e-6 at 16..32) is an absolute error there; and nearly all values bit-equal
    bound = FP16_STEP * np.maximum(np.abs(a), np.abs(b)) + absolute
    assert (np.abs(a - b) <= bound).all(), f"{case}: {np.abs(a - b).max()} apart"
    assert (got == want).mean() > share, f"{case}: {(got != want).mean():.4f} of the values differ"


# -- the layouts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_restore_equals_the_numpy_reference(case, kind, chunks):
    layout, planes, side, g, at = chunks[case]
    want = REFERENCE[layout.name](layout, planes, side, g, **at)
    given = planes if kind == "numpy" else torch.from_numpy(planes.copy())
    out = layout.from_planes_torch(given, side, g, CPU, **at)
    assert isinstance(out, torch.Tensor) and out.device == CPU
    assert_restores_alike(case, out, want)
    host = layout.from_planes(planes, side, g, **at)  # the numpy face: the same implementation
    assert isinstance(host, np.ndarray) and np.array_equal(host, out.numpy())


@pytest.mark.parametrize("token_start", [0, 256, 4096 - 128, 70_000])
def test_rope_tables_give_the_numpy_rotation_at_any_position(token_start, chunks):
    """Cached table slices, a grown table, and positions past the cache all rotate as profiles.rope."""
    layout, planes, side, g, _ = chunks["pca"]
    want = ref_pca(layout, planes, side, g, token_start)
    assert_restores_alike("pca", layout.from_planes_torch(planes, side, g, CPU, token_start=token_start), want)


def test_the_planes_are_never_written_and_the_kv_is_its_own_memory(chunks):
    for case in ("native16", "q8"):
        layout, planes, side, g, at = chunks[case]
        given = torch.from_numpy(planes.copy())
        before = given.clone()
        out = layout.from_planes_torch(given, side, g, CPU, **at)
        assert torch.equal(given, before)
        assert out.untyped_storage().data_ptr() != given.untyped_storage().data_ptr()


# -- serving.restore.restore ---------------------------------------------------------------------------
SCHEMES = ["int8-zstd", "lossless8", "raw", "nlevel-zstd", "cachegen", "transform-zstd", "video", "kvtc", "kvtc-w"]


@pytest.fixture(scope="module")
def decoded(tiny_profile):
    """scheme -> its chunk (a float32 engine for raw) decoded once at token_start 512."""
    kv = synthetic_kv(22)
    out = {}
    decoder = ChunkDecoder("m", auth=AUTH)
    for name in SCHEMES:
        scheme = on_tiny_profile(get_scheme(name, kv_dtype="float32") if name == "raw" else get_scheme(name))
        blob = ChunkEncoder(scheme, "m", auth=AUTH).encode(kv, "k", 2, 512)
        out[name] = decoder.decode(blob, key="k")
    decoder.close()
    return out


def _reference(d: Decoded) -> np.ndarray:
    layout = get_layout(d.header.layout, **d.header.layout_params)
    at = {"token_start": d.header.token_start} if layout.needs_positions else {}
    return REFERENCE[layout.name](layout, d.planes, d.side, d.header.geometry, **at)


def _case(d: Decoded) -> str:
    return d.header.layout


@pytest.mark.parametrize("name", SCHEMES)
def test_restore_of_numpy_planes_is_numpy_unless_a_device_is_named(name, decoded):
    d = decoded[name]
    want = _reference(d)
    host = restore(d)
    assert isinstance(host, np.ndarray)
    assert_restores_alike(_case(d), host, want)
    for device in (CPU, "cpu"):
        on = restore(d, device)
        assert isinstance(on, torch.Tensor) and on.device == CPU
        assert np.array_equal(on.numpy(), host)


@pytest.mark.parametrize("name", SCHEMES)
def test_restore_of_torch_planes_stays_on_their_device(name, decoded):
    d = decoded[name]
    planes = torch.from_numpy(np.array(d.planes))
    out = restore(Decoded(d.header, planes, d.side))
    assert isinstance(out, torch.Tensor) and out.device == planes.device
    assert np.array_equal(out.numpy(), restore(d))
    assert out.dtype == (torch.float32 if name == "raw" else torch.float16)


def test_restore_step_hands_back_a_tensor_on_its_device_and_the_numpy_empty_kv_on_failure(decoded):
    d = decoded["int8-zstd"]
    step = RestoreStep(CPU)
    info = ChunkInfo("s", 0, 1, token_start=512, tokens=256)
    kv = step.run(info, d)
    assert info.ok and isinstance(kv, torch.Tensor) and kv.device == CPU
    bad = Decoded(d.header, d.planes, {k: v for k, v in d.side.items() if k != "q8_step"})
    info = ChunkInfo("s", 0, 1, token_start=512, tokens=256)
    assert step.run(info, bad) is EMPTY_KV and info.status == "corrupt"
    step.close()


def test_planes_of_the_wrong_dtype_or_shape_are_corrupt_as_tensors_too(decoded):
    d = decoded["int8-zstd"]
    for planes in (torch.from_numpy(d.planes.astype(np.int16)), torch.from_numpy(np.array(d.planes[:-1]))):
        with pytest.raises(CorruptChunk, match="planes are"):
            restore(Decoded(d.header, planes, d.side), CPU)


def test_kv_that_is_not_finite_is_corrupt(decoded):
    d = decoded["int8-zstd"]
    step = np.frombuffer(d.side["q8_step"], np.float16).copy()
    step[5] = np.inf
    side = dict(d.side, q8_step=step.tobytes())
    for planes in (d.planes, torch.from_numpy(np.array(d.planes))):
        with pytest.raises(CorruptChunk, match="not finite"):
            restore(Decoded(d.header, planes, side), CPU)


# -- damaged side data: the same typed errors, raised before anything is put on the device --------------
DAMAGE = [
    ("int8-zstd", {"q8_min": None}, CorruptChunk, "side data"),
    ("int8-zstd", {"q8_step": b"\x00\x3c"}, CorruptChunk, "side data"),
    ("nlevel-zstd", {"qn_step": b"\x00\x7c" * 1536}, CorruptChunk, "non-finite"),
    ("cachegen", {"cg_max": b"\x00"}, CorruptChunk, "side data"),
    ("transform-zstd", {"pca_profile": b"0" * 32}, ForeignChunk, "codec profile"),
    ("transform-zstd", {"pca_step": np.full(8, np.nan, np.float32).tobytes()}, CorruptChunk, "non-finite"),
    ("video", {"pca_shift": b"\x10" * (4 * 2 * 192)}, CorruptChunk, "shift above 15"),
    ("video", {"pca_shift": b"\x00"}, CorruptChunk, "malformed"),
]


@pytest.mark.parametrize("name, change, error, match", DAMAGE, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_side_data_raises_typed_errors_before_allocating(name, change, error, match, decoded, monkeypatch):
    d = decoded[name]
    side = {k: v for k, v in dict(d.side, **change).items() if v is not None}

    def no_allocation(*args, **kwargs):
        raise AssertionError("a tensor was made before the side data was checked")

    for module in (quant, transform, tensors):
        monkeypatch.setattr(module, "as_tensor", no_allocation)
    for module in (quant, transform, cachegen):
        monkeypatch.setattr(module, "side_tensor", no_allocation)
    monkeypatch.setattr(cachegen, "as_tensor", no_allocation)
    monkeypatch.setattr(nlevel, "per_channel", no_allocation)
    for planes in (d.planes, torch.from_numpy(np.array(d.planes))):
        with pytest.raises(error, match=match):
            restore(Decoded(d.header, planes, side), CPU)


# -- a GPU (opt-in: skipped where torch sees none) ------------------------------------------------------
@on_gpu
@pytest.mark.parametrize("name", SCHEMES)
def test_cuda_restore_matches_the_cpu_and_stays_on_the_gpu(name, decoded):
    d = decoded[name]
    cuda = torch.device("cuda", 0)
    want = restore(d)
    for planes in (d.planes, torch.from_numpy(np.array(d.planes)).to(cuda)):
        out = restore(Decoded(d.header, planes, d.side), cuda)
        assert out.device.type == "cuda"
        # another matrix product (cuBLAS, no TF32 by default) for pca / pca10: a few float32 bits of
        # partial sums in the tens
        assert_restores_alike("pca10" if d.header.layout.startswith("pca") else _case(d), out, want,
                              absolute=1e-4, share=0.9)
    assert restore(Decoded(d.header, torch.from_numpy(np.array(d.planes)).to(cuda), d.side)).device.type == "cuda"


# -- the Triton edge (kv_restore's model.py) on a stand-in for triton_python_backend_utils --------------
class FakeTensor:
    """What ``pb_utils.Tensor`` offers the adapters: numpy-backed, or made from DLPack (kept as torch)."""

    def __init__(self, name, value):
        self.name, self.value = name, value

    @classmethod
    def from_dlpack(cls, name, value):
        assert isinstance(value, torch.Tensor) and value.is_contiguous()
        return cls(name, ("dlpack", value))

    def is_cpu(self):
        return isinstance(self.value, np.ndarray) or self.value.device.type == "cpu"

    def as_numpy(self):
        return self.value

    def to_dlpack(self):
        return torch.utils.dlpack.to_dlpack(self.value)


@pytest.fixture
def pb_utils(monkeypatch):
    """A ``triton_python_backend_utils`` module stand-in; ``kvcodec.triton`` and kv_restore's model.py
    imported against it (and forgotten afterwards)."""
    import sys

    from .fake_triton import exec_step, load_step

    fake = load_step(monkeypatch, "kv_restore", tensor=FakeTensor)
    exec_step(fake)
    yield fake
    sys.modules.pop("kvcodec.triton", None)


@pytest.mark.parametrize("args, want", [
    ({"model_instance_kind": "CPU", "model_instance_device_id": "0"}, "cpu"),
    ({"model_instance_kind": "GPU", "model_instance_device_id": "1"}, "cuda:1"),
    ({"model_instance_kind": "KIND_GPU", "model_instance_device_id": "0"}, "cuda:0"),
    ({}, "cpu"),
])
def test_the_instance_device_comes_from_triton_s_args(args, want, pb_utils):
    from kvcodec.triton import instance_device

    assert instance_device(args) == torch.device(want)


def _request(d: Decoded, info: ChunkInfo, planes=None) -> dict:
    from kvcodec.serving.restore import descriptor

    header, side = descriptor(d)
    planes = d.planes if planes is None else planes
    wide = str(planes.dtype).endswith("uint16")
    empty8, empty16 = np.zeros((0, 0, 0), np.uint8), np.zeros((0, 0, 0), np.uint16)
    tensors = {"chunk_info": np.array([info.to_json().encode()], dtype=object),
               "chunk_header": np.array([header.encode()], dtype=object), "side": side,
               "planes8": empty8 if wide else planes, "planes16": planes if wide else empty16,
               "input_ids": np.zeros(3, np.int32), "max_tokens": np.array([4], np.int32)}
    return {name: FakeTensor(name, value[None]) for name, value in tensors.items()}  # the batch dimension


@pytest.mark.parametrize("name", ["int8-zstd", "raw", "video"])
def test_kv_restore_sends_the_kv_of_its_dtype_on_a_cpu_instance_as_numpy(name, decoded, pb_utils):
    model = pb_utils.model.TritonPythonModel()
    model.initialize({"model_instance_kind": "CPU", "model_instance_device_id": "0", "model_config": "{}"})
    d = decoded[name]
    info = ChunkInfo("s", 0, 1, token_start=512, tokens=256)
    [response] = model.execute([_request(d, info)])
    assert response.error is None
    kv, kv32 = response.tensors["kv"].value[0], response.tensors["kv32"].value[0]  # the one row of the batch
    full, empty = (kv32, kv) if name == "raw" else (kv, kv32)
    assert isinstance(full, np.ndarray) and full.flags.c_contiguous and np.array_equal(full, restore(d))
    assert empty.shape == (0, 2, 0, 0, 0) and kv.dtype == np.float16 and kv32.dtype == np.float32
    model.finalize()


def test_kv_restore_takes_device_planes_through_dlpack(decoded, pb_utils, monkeypatch):
    """Planes that Triton left on a device come in as torch tensors, not copied to numpy (here a CPU
    tensor stands for the GPU one: ``is_cpu`` answers no)."""
    from kvcodec import triton as edge

    d = decoded["video"]
    request = _request(d, ChunkInfo("s", 0, 1, token_start=512, tokens=256), torch.from_numpy(np.array(d.planes)))
    monkeypatch.setattr(request["planes16"], "is_cpu", lambda: False)
    planes = edge.get_tensor(request, "planes16", np.uint16)
    assert isinstance(planes, torch.Tensor) and planes.dtype == torch.uint16
    with pytest.raises(Exception, match="must be uint8, got uint16"):
        edge.get_tensor(request, "planes16", np.uint8)


@on_gpu
def test_kv_restore_on_a_gpu_instance_sends_the_kv_through_dlpack(decoded, pb_utils):
    model = pb_utils.model.TritonPythonModel()
    model.initialize({"model_instance_kind": "GPU", "model_instance_device_id": "0", "model_config": "{}"})
    d = decoded["int8-zstd"]
    cuda_planes = torch.from_numpy(np.array(d.planes)).cuda()
    [response] = model.execute([_request(d, ChunkInfo("s", 0, 1, token_start=512, tokens=256), cuda_planes)])
    kind, kv = response.tensors["kv"].value
    assert kind == "dlpack" and kv.device.type == "cuda" and np.array_equal(kv[0].cpu().numpy(), restore(d))

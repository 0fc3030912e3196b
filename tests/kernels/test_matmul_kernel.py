"""Tests for meganeura.kernels.matmul: run the generated WGSL on the wgpu adapter (lavapipe on CPU)
and compare with numpy. Operands are strided views of flat buffers (transposed, batch-broadcast,
offset), so the kernel is checked to go through load_a / load_b and never assume contiguity.
Every run also records store_c calls per element and any out-of-range index the kernel passes."""

import re
from dataclasses import dataclass

import numpy as np
import pytest

from meganeura.kernels.matmul import fold_grid, matmul_kernel
from meganeura.kernels.matmul_plans import split_k
from meganeura.kernels.matmul_split_sum import split_reduce_kernel

wgpu = pytest.importorskip("wgpu")

STORAGE_LIMIT = "max-compute-workgroup-storage-size"
GRID_LIMIT = "max-compute-workgroups-per-dimension"


@dataclass
class Operand:
    """A logical (batch, rows, cols) f32 array stored at `offset` in `flat` with element `strides`."""
    flat: np.ndarray
    offset: int
    strides: tuple[int, int, int]
    shape: tuple[int, int, int]

    def view(self) -> np.ndarray:
        item = self.flat.itemsize
        return np.lib.stride_tricks.as_strided(
            self.flat[self.offset:], self.shape, [s * item for s in self.strides], writeable=False)

    def index_wgsl(self, b: str, r: str, c: str) -> str:
        sb, sr, sc = self.strides
        return f"{self.offset}u + {b} * {sb}u + {r} * {sr}u + {c} * {sc}u"


def make_operand(rng, batch: int, rows: int, cols: int, layout: str = "contiguous", offset: int = 0) -> Operand:
    """layout: contiguous (b, r, c) | transposed (b, c, r) in memory | broadcast (one (r, c) for all b)."""
    if layout == "contiguous":
        count, strides = batch * rows * cols, (rows * cols, cols, 1)
    elif layout == "transposed":
        count, strides = batch * rows * cols, (rows * cols, 1, rows)
    elif layout == "broadcast":
        count, strides = rows * cols, (0, cols, 1)
    else:
        raise ValueError(layout)
    # Positive values: no cancellation, so rtol=1e-4 holds for any k.
    flat = rng.uniform(0.25, 1.0, size=max(offset + count, 4)).astype(np.float32)
    return Operand(flat, offset, strides, (batch, rows, cols))


def vector_loader(name: str, operand: Operand, bound_other: int, bound_quads: int) -> str:
    """``load_<name>4(bi, o, c4)``: vec4 number c4 along the operand's unit-stride axis at coordinate o of its other
    axis, read through binding ``<name>4`` (the same buffer typed as vec4s); checks that the row starts on a vec4
    and that the indices are in range."""
    sb, sr, sc = operand.strides
    unit_rows = sr == 1  # the unit-stride axis is the operand's rows (A's i, B's p); else its columns
    other = sc if unit_rows else sr
    assert (sc if unit_rows else sr) != 1 and 1 in (sr, sc)
    return f"""
fn load_{name}4(bi: u32, o: u32, c4: u32) -> vec4<f32> {{
    let start = {operand.offset}u + bi * {sb}u + o * {other}u;
    check_index(start % 4u == 0u && o < {bound_other}u && 4u * c4 + 3u < {bound_quads}u);
    return {name}4[start / 4u + c4];
}}
@group(0) @binding({7 if name == "a" else 8}) var<storage, read_write> {name}4: array<vec4<f32>>;
"""


def build_prelude(a: Operand, b: Operand, *, batch: int, m: int, n: int, k: int, epilogue: str,
                  vector_loads: str = "") -> str:
    loaders = ""
    if "a" in vector_loads:  # A: (bi, i, c4) along p, or (bi, p, c4) along i
        loaders += vector_loader("a", a, m, k) if a.strides[2] == 1 else vector_loader("a", a, k, m)
    if "b" in vector_loads:  # B: (bi, p, c4) along j, or (bi, j, c4) along p
        loaders += vector_loader("b", b, k, n) if b.strides[2] == 1 else vector_loader("b", b, n, k)
    return loaders + f"""
@group(0) @binding(0) var<storage, read_write> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<storage, read_write> visits: array<f32>;
@group(0) @binding(4) var<storage, read_write> bad_index: array<f32>;
@group(0) @binding(5) var<storage, read_write> bias: array<f32>;
@group(0) @binding(6) var<storage, read_write> slices: array<f32>;

fn check_index(ok: bool) {{ if (!ok) {{ bad_index[0] = 1.0; }} }}

fn load_a(bi: u32, i: u32, p: u32) -> f32 {{
    check_index(bi < {batch}u && i < {m}u && p < {k}u);
    return a[{a.index_wgsl("bi", "i", "p")}];
}}

fn load_b(bi: u32, p: u32, j: u32) -> f32 {{
    check_index(bi < {batch}u && p < {k}u && j < {n}u);
    return b[{b.index_wgsl("bi", "p", "j")}];
}}

fn store_c(bi: u32, i: u32, j: u32, acc: f32) {{
    check_index(bi < {batch}u && i < {m}u && j < {n}u);
    let index = (bi * {m}u + i) * {n}u + j;
    visits[index] = visits[index] + 1.0;
    c[index] = {epilogue};
}}
"""


WORKGROUP_ARRAY = r"var<workgroup>\s+\w+\s*:\s*array<(f32|vec4<f32>|vec4<f16>),\s*(\d+)>"
ELEMENT_BYTES = {"f32": 4, "vec4<f32>": 16, "vec4<f16>": 8}


def workgroup_storage_bytes(source: str) -> int:
    sizes = re.findall(WORKGROUP_ARRAY, source)
    assert "var<workgroup>" not in re.sub(WORKGROUP_ARRAY, "", source)
    return sum(ELEMENT_BYTES[kind] * int(size) for kind, size in sizes)


@pytest.fixture(scope="module")
def device():
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    if adapter is None:
        pytest.skip("no wgpu adapter")
    wanted = ("max-storage-buffer-binding-size", "max-buffer-size", STORAGE_LIMIT,
              "max-storage-buffers-per-shader-stage", "max-compute-invocations-per-workgroup",
              "max-compute-workgroup-size-x")
    return adapter.request_device_sync(required_limits={key: adapter.limits[key] for key in wanted})


def run_matmul(device, a: Operand, b: Operand, *, epilogue="acc", bias=None, limits=None, **layout):
    """Generate, check and run one kernel. Returns (c, visits, bad_index, source, workgroups)."""
    batch, m, k = a.shape
    assert b.shape == (batch, k, b.shape[2])
    n = b.shape[2]
    limits = dict(limits or device.limits)
    vector_loads = layout.get("vector_loads", "")
    prelude = build_prelude(a, b, batch=batch, m=m, n=n, k=k, epilogue=epilogue, vector_loads=vector_loads)
    split = layout.get("split", 1)
    source, workgroups = matmul_kernel(prelude, batch=batch, m=m, n=n, k=k, limits=limits, **layout,
                                       **({"partial": "slices"} if split > 1 else {}))
    assert source.startswith(("enable f16;\n" if layout.get("f16") else "") + prelude) and "fn main(" in source
    assert workgroup_storage_bytes(source) <= limits[STORAGE_LIMIT]
    assert all(1 <= count <= limits[GRID_LIMIT] for count in workgroups)
    kernels = [(source, workgroups)]
    if split > 1:
        kernels.append(split_reduce_kernel(prelude, batch=batch, m=m, n=n, split=split, partial="slices",
                                           limits=limits))

    outputs = batch * m * n
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
    bias = np.zeros(4, np.float32) if bias is None else np.asarray(bias, np.float32)
    arrays = [a.flat, b.flat, np.full(outputs, np.nan, np.float32), np.zeros(outputs, np.float32),
              np.zeros(4, np.float32), bias, np.full(max(split * outputs, 4), np.nan, np.float32)]
    buffers = [device.create_buffer_with_data(data=array, usage=usage) for array in arrays]
    if vector_loads:  # bindings 7 and 8: A and B again, as vec4s
        buffers += [buffers[0], buffers[1]]
    entries = [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE,
                "buffer": {"type": wgpu.BufferBindingType.storage}} for i in range(len(buffers))]
    group_layout = device.create_bind_group_layout(entries=entries)
    bind_group = device.create_bind_group(layout=group_layout, entries=[
        {"binding": i, "resource": {"buffer": buffer, "offset": 0, "size": buffer.size}}
        for i, buffer in enumerate(buffers)])
    encoder = device.create_command_encoder()
    compute_pass = encoder.begin_compute_pass()
    for kernel_source, grid in kernels:
        pipeline = device.create_compute_pipeline(
            layout=device.create_pipeline_layout(bind_group_layouts=[group_layout]),
            compute={"module": device.create_shader_module(code=kernel_source), "entry_point": "main"})
        compute_pass.set_pipeline(pipeline)
        compute_pass.set_bind_group(0, bind_group)
        compute_pass.dispatch_workgroups(*grid)
    compute_pass.end()
    device.queue.submit([encoder.finish()])

    def read(buffer):
        return np.frombuffer(device.queue.read_buffer(buffer), np.float32)

    c = read(buffers[2]).reshape(batch, m, n)
    return c, read(buffers[3]).reshape(batch, m, n), read(buffers[4])[0], source, workgroups


def check(device, a: Operand, b: Operand, *, limits=None, **layout):
    c, visits, bad_index, source, workgroups = run_matmul(device, a, b, limits=limits, **layout)
    expected = np.matmul(a.view().astype(np.float64), b.view().astype(np.float64))
    np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-5)
    assert bad_index == 0.0, "kernel passed an out-of-range index to load/store"
    assert np.all(visits == 1.0), "store_c must run exactly once per output"
    return source, workgroups


@pytest.mark.parametrize("batch, m, n, k", [
    (1, 64, 64, 64),      # square, one 64-edge tile per dimension after shrinking
    (1, 1, 1, 1),
    (1, 3, 5, 7),
    (1, 33, 65, 17),      # ragged tiles on every side, K not a multiple of the chunk
    (1, 100, 1, 50),      # n == 1: gemv over rows
    (1, 1, 200, 300),     # m == 1: gemv over columns
    (1, 130, 70, 1),      # k == 1
    (1, 130, 1, 70),      # n == 1, ragged row blocks
    (3, 17, 9, 40),       # batched, small
    (2, 1, 3, 5000),      # m == 1, long K: many lanes per output
])
def test_shapes(device, batch, m, n, k):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    check(device, make_operand(rng, batch, m, k), make_operand(rng, batch, k, n))


@pytest.mark.parametrize("m, n", [(5, 7), (1, 9), (9, 1)])
def test_k_zero_stores_zero(device, m, n):
    rng = np.random.default_rng(0)
    c, visits, bad_index, _, _ = run_matmul(device, make_operand(rng, 2, m, 0), make_operand(rng, 2, 0, n))
    assert np.all(c == 0.0) and np.all(visits == 1.0) and bad_index == 0.0


@pytest.mark.parametrize("m, n, k", [(40, 24, 33), (1, 24, 33), (40, 1, 33)])
def test_broadcast_a_transposed_b_with_offsets(device, m, n, k):
    rng = np.random.default_rng(1)
    a = make_operand(rng, 3, m, k, layout="broadcast", offset=5)
    b = make_operand(rng, 3, k, n, layout="transposed", offset=3)   # load_b reads b[j*k + p]
    assert b.strides[1:] == (1, k)
    check(device, a, b)


def test_transposed_a(device):
    rng = np.random.default_rng(2)
    check(device, make_operand(rng, 2, 45, 30, layout="transposed"), make_operand(rng, 2, 30, 50))


@pytest.mark.parametrize("a_fast, b_fast, tile", [("i", "p", None), ("p", "p", (128, 128)), ("i", "j", (128, 64)),
                                                  ("i", "p", (16, 128))])
def test_layout_hints_and_forced_tiles(device, a_fast, b_fast, tile):
    """Every thread order and tile is correct on any layout (here ragged edges and a batch of 2)."""
    rng = np.random.default_rng(8)
    a = make_operand(rng, 2, 131, 37, layout="transposed" if a_fast == "i" else "contiguous")
    b = make_operand(rng, 2, 37, 70, layout="transposed" if b_fast == "p" else "contiguous")
    check(device, a, b, a_fast=a_fast, b_fast=b_fast, tile=tile)


@pytest.mark.parametrize("tile, block", [((64, 64), (8, 8)), ((64, 64), (8, 4)), ((32, 64), (4, 8)),
                                         ((128, 64), (4, 4)), ((16, 32), (8, 8)), ((128, 128), (8, 16)),
                                         ((128, 256), (8, 16)), ((64, 96), (4, 4))])
def test_forced_register_blocks(device, tile, block):
    """Every register block is correct on ragged edges, with the thread count it implies."""
    rng = np.random.default_rng(12)
    a, b = make_operand(rng, 2, 75, 41), make_operand(rng, 2, 41, 93, layout="transposed")
    source, _ = check(device, a, b, b_fast="p", tile=tile, block=block)
    rows, cols = min(block[0], tile[0]), min(block[1], tile[1])
    assert f"threads of {rows}x{cols}" in source
    assert f"@workgroup_size({tile[0] // rows * tile[1] // cols})" in source


@pytest.mark.parametrize("m, n, k", [(20, 36, 24), (1, 36, 24)])
def test_epilogue_bias_relu(device, m, n, k):
    rng = np.random.default_rng(3)
    a, b = make_operand(rng, 1, m, k), make_operand(rng, 1, k, n)
    product = np.matmul(a.view().astype(np.float64), b.view().astype(np.float64))
    bias = -np.median(product, axis=(0, 1)) + rng.uniform(-0.5, 0.5, n)   # about half clip
    c, visits, bad_index, _, _ = run_matmul(device, a, b, epilogue="max(acc + bias[j], 0.0)", bias=bias)
    expected = np.maximum(product + bias.astype(np.float32), 0.0)
    assert 0 < np.count_nonzero(expected) < expected.size
    np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-5)
    assert np.all(visits == 1.0) and bad_index == 0.0


@pytest.mark.parametrize("batch, m, n, k, split, tile", [
    (1, 20, 30, 1000, 4, None),       # slices of 256: the last one shorter
    (2, 33, 65, 700, 8, (32, 64)),    # ragged tiles, batched, slices of 88 (whole chunks of 8)
    (1, 16, 16, 37, 16, (16, 16)),    # more slices than chunks: trailing slices are empty
])
def test_split_k(device, batch, m, n, k, split, tile):
    rng = np.random.default_rng(9)
    a, b = make_operand(rng, batch, m, k), make_operand(rng, batch, k, n, layout="transposed")
    source, _ = check(device, a, b, split=split, tile=tile, b_fast="p")
    assert f"K in {split} slices" in source


@pytest.mark.parametrize("batch, m, n, k, split, tile, grid_limit", [
    (2, 64, 128, 96, 1, (64, 64), None),      # every range check left out
    (1, 64, 64, 512, 4, (32, 64), None),      # whole slices of whole chunks: no K check
    (1, 64, 70, 512, 4, (32, 64), None),      # ragged columns only
    (1, 96, 64, 40, 1, (32, 32), None),       # K not whole chunks: K checked, rows and columns not
    (40, 32, 32, 32, 1, (32, 32), 7),         # folded grid rounded up: workgroups without a tile
])
def test_range_checks_left_out_where_the_shape_allows(device, batch, m, n, k, split, tile, grid_limit):
    """Exact shapes get kernels without the checks they cannot fail; the results, the one store per element and
    the in-range indices are checked as everywhere."""
    rng = np.random.default_rng(13)
    limits = dict(device.limits, **({GRID_LIMIT: grid_limit} if grid_limit else {}))
    source, _ = check(device, make_operand(rng, batch, m, k), make_operand(rng, batch, k, n), split=split, tile=tile,
                      limits=limits)
    kernel = source[source.index("// ---- matmul"):]
    assert ("< M" in kernel) == (m % tile[0] != 0)
    assert ("< N" in kernel) == (n % tile[1] != 0)
    assert bool(re.search(r"\+ p\d+ < k_end", kernel)) == (k % (split * 16) != 0)
    assert ("live" in kernel) == (grid_limit is not None)


@pytest.mark.parametrize("looped, batch, m, n, k, split, tile, grid_limit", [
    ("b", 1, 16, 300, 70, 1, (16, 64), None),    # ragged columns and K: every check inside the loop
    ("b", 1, 2, 130, 256, 4, (16, 64), None),    # K slices (the sibling projections' shape), ragged rows
    ("a", 2, 70, 64, 33, 1, (64, 64), None),     # the A side, batched, ragged rows and K
    ("a", 40, 32, 32, 32, 1, (32, 32), 7),       # folded grid: workgroups without a tile
])
def test_looped_fetch_matches(device, looped, batch, m, n, k, split, tile, grid_limit):
    """An operand fetched in a loop (one loader call, a switch into the staging registers) gives the same products,
    one store per element and in-range indices; its loader is called once per fetch in the source."""
    rng = np.random.default_rng(17)
    limits = dict(device.limits, **({GRID_LIMIT: grid_limit} if grid_limit else {}))
    source, _ = check(device, make_operand(rng, batch, m, k), make_operand(rng, batch, k, n, layout="transposed"),
                      split=split, tile=tile, limits=limits, looped=looped, b_fast="p")
    kernel = source[source.index("// ---- matmul"):]
    assert kernel.count(f"load_{looped}(") == 2  # the first chunk's fetch and the loop's


@pytest.mark.parametrize("batch, m, n, k, layout", [
    (1, 64, 64, 64, {"tile": (64, 64)}),                            # every range check left out
    (2, 75, 93, 41, {"tile": (64, 64), "block": (8, 8)}),           # ragged tiles, K not whole chunks
    (1, 33, 65, 17, {}),                                            # the generator's own tile
    (1, 131, 70, 300, {"tile": (128, 64), "block": (8, 8)}),        # 8x8 blocks, a long K, ragged
    (1, 40, 50, 700, {"tile": (32, 64), "split": 4}),               # K slices of whole chunks
    (1, 16, 16, 37, {"tile": (16, 16), "split": 16}),               # more slices than chunks: empty slices
    (40, 32, 32, 40, {"tile": (32, 32), "grid": 7}),                # folded grid: workgroups without a tile
    (1, 70, 64, 33, {"tile": (64, 64), "looped": "a"}),             # an operand fetched in a loop
])
def test_double_buffered_chunks_match(device, batch, m, n, k, layout):
    """Double-buffered K chunks (two in workgroup memory, one barrier a chunk): the same products, one store per
    element, in-range indices, on every shape the single-buffered kernel serves."""
    rng = np.random.default_rng(m + n + k)
    grid = layout.pop("grid", None)
    limits = dict(device.limits, **({GRID_LIMIT: grid} if grid else {}))
    source, _ = check(device, make_operand(rng, batch, m, k), make_operand(rng, batch, k, n, layout="transposed"),
                      b_fast="p", limits=limits, double=True, **layout)
    kernel = source[source.index("// ---- matmul"):]
    assert "double-buffered" in kernel and kernel.count("workgroupBarrier()") == 2  # before the loop, and in it


def test_double_buffering_only_where_two_chunks_fit():
    """At WebGPU's default workgroup storage (16 KiB) a 64x64 tile's chunk of 16 takes 8.5 KiB: not two of them, so
    the kernel keeps one buffer and its chunk rather than halving the chunk; a 32x64 tile's (6.5 KiB) takes two."""
    assert header(1, 512, 512, 512, double=True) == header(1, 512, 512, 512)
    assert header(1, 512, 512, 512).startswith("tiled 64x64, K chunk 16")
    assert header(1, 128, 576, 64, double=True) == header(1, 128, 576, 64) + ", double-buffered"
    assert header(1, 128, 576, 64).startswith("tiled 32x64, K chunk 16")


def test_split_k_choice():
    assert split_k(1, 64, 147, 50176, LIMITS) == 64       # a convolution's weight gradient: 3 tiles, long K
    assert split_k(1, 196, 1024, 2304, LIMITS) == 16      # 64 tiles
    assert split_k(1, 50, 2048, 720, LIMITS) == 8         # a projection of 50 tokens: 32 tiles
    assert split_k(1, 4096, 4096, 4096, LIMITS) == 1      # enough tiles already
    assert split_k(1, 64, 64, 600, LIMITS) == 8           # one tile: slices of at least 64
    assert split_k(1, 64, 64, 300, LIMITS) == 1           # K under SPLIT_FROM_K: one pass
    assert split_k(1, 64, 64, 100, LIMITS) == 1           # K too short to halve
    assert split_k(1, 1, 4096, 4096, LIMITS) == 1         # gemv


def test_grid_fold_large_batch(device):
    rng = np.random.default_rng(4)
    _, workgroups = check(device, make_operand(rng, 70000, 2, 2), make_operand(rng, 70000, 2, 2))
    assert workgroups[0] <= 65535 and workgroups[1] > 1
    assert workgroups[0] * workgroups[1] * workgroups[2] >= 70000


@pytest.mark.parametrize("batch, m, n", [(5000, 2, 3), (300, 1, 5), (300, 5, 1)])
def test_grid_fold_3d_with_small_limit(device, batch, m, n):
    rng = np.random.default_rng(5)
    limits = dict(device.limits)
    limits[GRID_LIMIT] = 16 if m == 1 or n == 1 else 64
    _, workgroups = check(device, make_operand(rng, batch, m, 3), make_operand(rng, batch, 3, n), limits=limits)
    assert max(workgroups) <= limits[GRID_LIMIT] and workgroups[2] > 1


def test_small_workgroup_storage_limit(device):
    rng = np.random.default_rng(6)
    limits = dict(device.limits)
    limits[STORAGE_LIMIT] = 2048
    source, _ = check(device, make_operand(rng, 1, 64, 64), make_operand(rng, 1, 64, 64), limits=limits)
    assert workgroup_storage_bytes(source) <= 2048


def test_small_invocation_limit(device):
    rng = np.random.default_rng(7)
    limits = dict(device.limits)
    limits["max-compute-invocations-per-workgroup"] = 128
    for m, n in [(40, 50), (1, 50)]:
        source, _ = check(device, make_operand(rng, 1, m, 20), make_operand(rng, 1, 20, n), limits=limits)
        size = int(re.search(r"@workgroup_size\((\d+)\)", source).group(1))
        assert size <= 128


# ---------------------------------------------------------------- no GPU needed

LIMITS = {GRID_LIMIT: 65535, STORAGE_LIMIT: 16384, "max-compute-invocations-per-workgroup": 256}


def header(batch, m, n, k, **variant):
    source, _ = matmul_kernel("", batch=batch, m=m, n=n, k=k, limits=LIMITS, **variant)
    return re.search(r"// ---- matmul: (.*)", source).group(1)


def test_k_chunk_keeps_each_threads_staging_within_its_register_budget():
    big = {**LIMITS, STORAGE_LIMIT: 49152}

    def forced(tile, block):
        source, _ = matmul_kernel("", batch=1, m=4096, n=4096, k=4096, limits=big, tile=tile, block=block)
        return re.search(r"// ---- matmul: (.*)", source).group(1)

    # 256 threads share a 128x256 tile's chunk of 16: 8 floats of A and 16 of B each
    assert forced((128, 256), (8, 16)).startswith("tiled 128x256, K chunk 16, 16x16 threads of 8x16")
    # 128 threads would hold 16 + 16 of a 128x128 chunk of 16: the chunk halves (storage would allow 16)
    assert forced((128, 128), (8, 16)).startswith("tiled 128x128, K chunk 8, 16x8 threads of 8x16")
    assert forced((128, 128), (8, 8)).startswith("tiled 128x128, K chunk 16, 16x16 threads of 8x8")


def test_tile_choice_by_shape():
    assert header(1, 4096, 4096, 4096).startswith("tiled 128x128, K chunk 8, 16x16 threads of 8x8")  # 16 KiB
    assert header(1, 1024, 1024, 1024).startswith("tiled 64x128")   # 128 workgroups
    assert header(1, 512, 512, 512).startswith("tiled 64x64")       # 16 tiles of 128x128 are too few
    assert header(32, 128, 128, 64).startswith("tiled 64x64")       # batch counts towards workgroups
    assert header(1, 128, 576, 64).startswith("tiled 32x64")        # 18 tiles of 64x64 are too few, K is short
    assert header(1, 128, 576, 320).startswith("tiled 32x64")       # K under SPLIT_FROM_K: smaller tiles, one pass
    assert header(1, 128, 576, 1536).startswith("tiled 64x64")      # a long K: split_k makes the workgroups
    assert header(1, 20, 20, 20).startswith("tiled 16x16, K chunk 8, 4x4 threads of 4x4")  # 16 would stage 32
    assert header(1, 7, 9, 3).startswith("tiled 16x16, K chunk 4")
    assert header(1, 1, 4096, 4096).startswith("gemv over columns, 2 outputs x 128 K lanes")  # at most 128 lanes
    assert header(1, 4096, 1, 64).startswith("gemv over rows, 32 outputs x 8 K lanes")  # 8 products per lane
    assert header(1, 1, 1, 10000).startswith("gemv over columns, 1 outputs x 256 K lanes")  # one output: all lanes


def test_gemv_lanes_give_each_a_short_run_of_k():
    """m = 1: K is split over the power of two of lanes that gives each about 8 products (16 where K is strided),
    between 4 and 128, fewer where the outputs are very many."""
    def lanes(n, k, b_fast):
        return re.search(r"x (\d+) K lanes", matmul_kernel("", batch=1, m=1, n=n, k=k, limits=LIMITS,
                                                          b_fast=b_fast)[0]).group(1)
    assert lanes(1536, 576, "p") == "64"   # contiguous K: about 8 products per lane
    assert lanes(576, 1536, "p") == "128"  # capped
    assert lanes(1024, 1024, "j") == "64"  # strided K: about 16 per lane
    assert lanes(49152, 576, "p") == "32"  # many outputs: fewer lanes, more outputs per workgroup
    assert lanes(64, 16, "p") == "4"       # at least 4


@pytest.mark.parametrize("b_fast, batch, n, k, lanes", [("p", 2, 41, 1100, 128), ("j", 1, 37, 1100, 64),
                                                         ("p", 1, 300, 576, 64)])
def test_gemv_with_many_lanes_matches(device, b_fast, batch, n, k, lanes):
    """The lane counts the rule gives long rows (several outputs per workgroup, ragged last block) sum right."""
    rng = np.random.default_rng(k + n)
    a = make_operand(rng, batch, 1, k)
    b = make_operand(rng, batch, k, n, layout="transposed" if b_fast == "p" else "contiguous")
    source, _ = check(device, a, b, b_fast=b_fast)
    assert f"x {lanes} K lanes" in source


def test_layout_hints_pick_the_thread_order():
    source, _ = matmul_kernel("", batch=1, m=64, n=64, k=64, limits=LIMITS, a_fast="i", b_fast="p")
    assert "A along i, B along p" in source
    gemv, _ = matmul_kernel("", batch=1, m=1, n=4096, k=4096, limits=LIMITS, b_fast="p")
    assert re.search(r"let lane = lid % \d+u;", gemv)  # lanes (K) fastest: the matrix is contiguous along K
    with pytest.raises(ValueError, match="a_fast"):
        matmul_kernel("", batch=1, m=4, n=4, k=4, limits=LIMITS, a_fast="j")


def test_storage_never_exceeds_limit():
    for storage in (640, 1024, 2048, 4096, 16384, 49152):  # WebGPU guarantees 16384
        limits = dict(LIMITS, **{STORAGE_LIMIT: storage})
        for shape in [(1, 4096, 4096, 4096), (8, 64, 64, 64), (1, 33, 65, 17)]:
            source, _ = matmul_kernel("", batch=shape[0], m=shape[1], n=shape[2], k=shape[3], limits=limits)
            assert workgroup_storage_bytes(source) <= storage


@pytest.mark.parametrize("total", [1, 65535, 65536, 70000, 10**6, 65535**2, 65535**2 + 1, 3 * 10**9])
def test_fold_grid(total):
    x, y, z = fold_grid(total, 65535)
    assert max(x, y, z) <= 65535 and x * y * z >= total
    assert x * y * z - total < x * y  # at most one partial layer of slack


def test_fold_grid_too_large():
    with pytest.raises(ValueError):
        fold_grid(17**3, 16)


@pytest.fixture(scope="module")
def f16_device():
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    if adapter is None or "shader-f16" not in adapter.features:
        pytest.skip("no adapter with shader-f16")
    wanted = ("max-storage-buffer-binding-size", "max-buffer-size", STORAGE_LIMIT,
              "max-storage-buffers-per-shader-stage", "max-compute-invocations-per-workgroup",
              "max-compute-workgroup-size-x")
    return adapter.request_device_sync(required_features=["shader-f16"],
                                       required_limits={key: adapter.limits[key] for key in wanted})


@pytest.mark.parametrize("batch, m, n, k, layout", [
    (1, 64, 64, 64, {}),
    (1, 33, 65, 17, {}),                                      # ragged tiles, K not a multiple of the chunk
    (2, 40, 72, 300, {"tile": (32, 64), "block": (4, 4)}),
    (1, 48, 40, 520, {"tile": (16, 32), "split": 4}),        # K slices: f32 partial sums, then the reduction
    (1, 70, 40, 100, {"tile": (64, 64), "double": True}),    # double-buffered f16 chunks
    (1, 70, 40, 100, {"tile": (64, 64), "quads": True, "patches": True}),  # quads: f16 components and vec4s
])
def test_f16_products_are_within_f16_rounding(f16_device, batch, m, n, k, layout):
    """f16 products: every output stored once and in range, off f64 by f16's rounding (about 1e-3 relative L2 for
    signed random operands) and no more; the kernel enables f16 and stages f16 tiles."""
    rng = np.random.default_rng(m + n + k)
    a, b = make_operand(rng, batch, m, k), make_operand(rng, batch, k, n, "transposed")
    for operand in (a, b):  # signed values: the f16 sums see cancellation
        operand.flat[:] = rng.standard_normal(operand.flat.size).astype(np.float32)
    c, visits, bad_index, source, _ = run_matmul(f16_device, a, b, f16=True, **layout)
    expected = np.matmul(a.view().astype(np.float64), b.view().astype(np.float64))
    rel_l2 = np.linalg.norm(c - expected) / np.linalg.norm(expected)
    assert 1e-5 < rel_l2 < 3e-3, rel_l2  # rounded to f16 (not f32-exact), and not worse than that
    np.testing.assert_allclose(c, expected, rtol=0, atol=0.02 * np.abs(expected).max())
    assert bad_index == 0.0 and np.all(visits == 1.0)
    assert source.startswith("enable f16;") and "array<vec4<f16>" in source


def test_f32_kernels_do_not_enable_f16(device):
    rng = np.random.default_rng(1)
    source, _ = check(device, make_operand(rng, 1, 40, 30), make_operand(rng, 1, 30, 50))
    assert "f16" not in source


@pytest.mark.parametrize("batch, m, n, k, layout", [
    (1, 64, 64, 64, {"tile": (64, 64)}),                            # every range check left out
    (2, 75, 93, 41, {"tile": (64, 64), "block": (8, 8)}),           # ragged tiles, K not whole chunks
    (1, 131, 70, 300, {"tile": (128, 64), "block": (8, 8)}),        # 8x8 blocks in patches, a long K, ragged
    (1, 130, 260, 37, {"tile": (128, 256), "block": (8, 16)}),      # the wide tile, ragged on every side
    (3, 17, 9, 40, {}),                                             # batched, the rule's 16x16 tile (no patches)
    (1, 1, 70, 50, {"tile": (16, 64)}),                             # 1 x N through the tiled kernel
    (1, 70, 1, 50, {"tile": (64, 16)}),                             # N x 1 through the tiled kernel
    (1, 40, 50, 700, {"tile": (64, 64), "split": 4}),               # K slices of whole chunks
    (1, 70, 64, 130, {"tile": (64, 64), "double": True}),           # double-buffered quads
    (1, 70, 130, 90, {"tile": (64, 64), "block": (8, 4)}),           # QUAD_TILE's default: 8x4 blocks, ragged
    (1, 70, 64, 33, {"tile": (64, 64), "looped": "a"}),             # A fetched in a loop: element staging for A
    (40, 32, 32, 40, {"tile": (32, 32), "grid": 7}),                # folded grid: workgroups without a tile
])
@pytest.mark.parametrize("a_layout, b_layout", [("contiguous", "contiguous"), ("transposed", "transposed")])
def test_quad_staging_and_thread_patches_match(device, batch, m, n, k, layout, a_layout, b_layout):
    """Quad staging with thread patches, against f64 (rtol 1e-4, positive operands): each output stored once, every
    index in range, on ragged tiles, 1 x N and N x 1, batches, K slices, double buffers and folded grids, with the
    operands' unit-stride axis along K (4 component stores into shared memory) or along the tile's edge (one vec4)."""
    rng = np.random.default_rng(m * 7 + n * 3 + k)
    grid = layout.pop("grid", None)
    limits = dict(device.limits, **({GRID_LIMIT: grid} if grid else {}))
    a_fast, b_fast = ("p", "j") if a_layout == "contiguous" else ("i", "p")
    source, _ = check(device, make_operand(rng, batch, m, k, a_layout), make_operand(rng, batch, k, n, b_layout),
                      a_fast=a_fast, b_fast=b_fast, limits=limits, quads=True, patches=True, **layout)
    kernel = source[source.index("// ---- matmul"):]
    assert "quad staging" in kernel
    threads_m, threads_n = map(int, re.search(r"(\d+)x(\d+) threads", kernel).groups())
    assert ("thread patches" in kernel) == (threads_m % 4 == 0 and threads_n % 8 == 0)  # patches of 4 x 8


@pytest.mark.parametrize("batch, m, n, k, layout", [
    (1, 64, 64, 64, {"tile": (64, 64)}),                            # every range check left out
    (2, 76, 92, 44, {"tile": (64, 64), "block": (8, 8)}),           # ragged tiles, K not whole chunks
    (1, 132, 72, 300, {"tile": (128, 64), "block": (8, 8), "double": True}),
    (1, 40, 52, 700, {"tile": (64, 64), "split": 4}),               # K slices of whole chunks
    (1, 4, 68, 52, {"tile": (16, 64)}),                             # a few rows through the tiled kernel
    (40, 32, 32, 40, {"tile": (32, 32), "grid": 7}),                # folded grid: workgroups without a tile
])
@pytest.mark.parametrize("a_layout, b_layout", [("contiguous", "contiguous"), ("transposed", "transposed")])
def test_vec4_loads_match(device, batch, m, n, k, layout, a_layout, b_layout):
    """Quad staging through vec4 loaders (rows of whole vec4s: the unit-stride axis a multiple of 4, offsets too),
    against f64 (rtol 1e-4): each output stored once, every loader index in range and each quad starting on a vec4
    (``vector_loader`` checks), ragged tiles, K slices, double buffers, folded grids, both operand layouts."""
    rng = np.random.default_rng(m * 5 + n * 3 + k)
    grid = layout.pop("grid", None)
    limits = dict(device.limits, **({GRID_LIMIT: grid} if grid else {}))
    a_fast, b_fast = ("p", "j") if a_layout == "contiguous" else ("i", "p")
    a = make_operand(rng, batch, m, k, a_layout, offset=8)
    b = make_operand(rng, batch, k, n, b_layout, offset=4)
    source, _ = check(device, a, b, a_fast=a_fast, b_fast=b_fast, limits=limits, quads=True, patches=True,
                      vector_loads="ab", **layout)
    kernel = source[source.index("// ---- matmul"):]
    assert "vec4 loads of AB" in kernel and "load_a4(" in kernel and "load_b4(" in kernel
    assert "load_a(" not in kernel and "load_b(" not in kernel


def test_vec4_loads_only_under_quad_staging_and_not_for_a_looped_operand():
    assert "vec4 loads" not in header(1, 64, 64, 64, vector_loads="ab")
    assert header(1, 64, 64, 64, quads=True, vector_loads="ab").endswith(", quad staging, vec4 loads of AB")
    assert header(1, 64, 64, 64, quads=True, vector_loads="ab", looped="a").endswith("vec4 loads of B")


# ---------------------------------------------------------------- tight double buffers (issue 51)

PORTABLE = {STORAGE_LIMIT: 16384, "max-compute-invocations-per-workgroup": 256, "max-compute-workgroup-size-x": 256}


@pytest.mark.parametrize("batch, m, n, k, layout, portable", [
    (1, 128, 128, 64, {"tile": (128, 128), "block": (8, 8), "unpadded": True}, True),   # two chunks of 8 in 16 KiB
    (2, 131, 133, 37, {"tile": (128, 128), "block": (8, 8), "unpadded": True}, True),   # ragged, batched, K not whole
    (1, 133, 131, 45, {"tile": (128, 128), "block": (8, 8), "unpadded": True, "quads": True, "patches": True}, True),
    (1, 130, 260, 37, {"tile": (128, 256), "block": (8, 16), "chunk": 8}, False),         # the wide tile, chunk of 8
    (1, 130, 260, 70, {"tile": (128, 256), "block": (8, 16), "chunk": 8, "unpadded": True, "quads": True,
                       "patches": True}, False),
    (3, 40, 50, 100, {"tile": (64, 64), "unpadded": True, "chunk": 4}, True),            # a small tile, chunk of 4
    (1, 40, 70, 50, {"tile": (32, 64), "block": (8, 8), "unpadded": True}, True),       # 4 threads span 8 vec4s
    (1, 40, 50, 700, {"tile": (64, 64), "unpadded": True, "chunk": 8, "split": 4}, True),  # unpadded K slices
])
@pytest.mark.parametrize("a_layout, b_layout", [("contiguous", "contiguous"), ("transposed", "transposed")])
def test_unpadded_and_capped_chunk_double_buffers_match(device, batch, m, n, k, layout, portable, a_layout, b_layout):
    """Double-buffered chunks without the shared rows' pad or at a capped chunk (the candidates that fit two chunks
    where the rule's padded chunk would not): against f64 (rtol 1e-4, positive operands), each output stored once,
    every index in range, within WebGPU's default limits where ``portable`` (else the adapter's), on both operand
    layouts (stores along K into shared memory, and along the tile's edge)."""
    rng = np.random.default_rng(m * 3 + n + k)
    limits = dict(device.limits, **PORTABLE) if portable else device.limits
    a_fast, b_fast = ("p", "j") if a_layout == "contiguous" else ("i", "p")
    source, _ = check(device, make_operand(rng, batch, m, k, a_layout), make_operand(rng, batch, k, n, b_layout),
                      a_fast=a_fast, b_fast=b_fast, limits=limits, double=True, **layout)
    kernel = source[source.index("// ---- matmul"):]
    assert ("unpadded" in kernel) == layout.get("unpadded", False)
    # unpadded: an operand stored along K (A contiguous, B transposed) is swizzled, in its stores and reads
    along_k = "tile_a[" if a_fast == "p" else "tile_b["
    assert bool(re.search(re.escape(along_k) + r"[^\]]*\^", kernel)) == layout.get("unpadded", False)
    other = "tile_b[" if a_fast == "p" else "tile_a["
    assert not re.search(re.escape(other) + r"[^\]]*\^", kernel)
    if "chunk" in layout:
        assert f"K chunk {layout['chunk']}," in kernel
    if layout.get("split", 1) == 1:
        assert "double-buffered" in kernel and kernel.count("workgroupBarrier()") == 2


def test_unpadded_rows_fit_two_chunks_exactly_where_the_pad_would_not():
    """Unpadded, a 128x128 tile's two chunks of 8 take WebGPU's 16 KiB exactly and a 128x256 tile's two of 16 an
    NVIDIA adapter's 48 KiB exactly; padded, each keeps one buffer (the pad passes the limit by 512 bytes)."""
    big = {**LIMITS, STORAGE_LIMIT: 49152}
    for limits, tile, block, chunk in ((LIMITS, (128, 128), (8, 8), 8), (big, (128, 256), (8, 16), 16)):
        def variant(**more):
            source, _ = matmul_kernel("", batch=1, m=4096, n=4096, k=4096, limits=limits, tile=tile, block=block,
                                      double=True, **more)
            return re.search(r"// ---- matmul: (.*)", source).group(1), workgroup_storage_bytes(source)

        unpadded, storage = variant(unpadded=True)
        assert unpadded.startswith(f"tiled {tile[0]}x{tile[1]}, K chunk {chunk},") and storage == limits[STORAGE_LIMIT]
        assert unpadded.endswith("double-buffered, unpadded")
        padded, storage = variant()
        assert "double-buffered" not in padded and storage <= limits[STORAGE_LIMIT]


def test_chunk_caps_the_rule_s_chunk():
    """``chunk`` caps the K chunk: the wide tile takes 8 (two buffers of it fit 48 KiB with the pad), a cap above
    the rule's chunk changes nothing, and a short K still rounds the chunk down."""
    big = {**LIMITS, STORAGE_LIMIT: 49152}

    def forced(k=4096, **more):
        source, _ = matmul_kernel("", batch=1, m=4096, n=4096, k=k, limits=big, tile=(128, 256), block=(8, 16), **more)
        return re.search(r"// ---- matmul: (.*)", source).group(1)

    assert forced(chunk=8, double=True).startswith("tiled 128x256, K chunk 8,")
    assert forced(chunk=8, double=True).endswith("double-buffered")
    assert forced(chunk=16) == forced()
    assert forced(k=4, chunk=8).startswith("tiled 128x256, K chunk 4,")


def _store_banks(edge: int, chunk: int, padded: bool, quads: bool) -> int:
    """The most threads of a warp whose store of an operand staged along K falls in one of 32 banks, under the
    layout of ``matmul_staging`` (one store instruction: each element, or component q of each quad)."""
    from meganeura.kernels.matmul_staging import shared_row, swizzle_span

    row, span = 4 * shared_row(edge, padded), 0 if padded else swizzle_span(edge)
    width = 4 if quads else 1
    worst = 0
    for q in range(width):
        banks = []
        for lane in range(32):
            p, r = width * (lane % (chunk // width)) + q, lane // (chunk // width)
            vec = (r // 4) ^ (p % span) if span else r // 4
            banks.append((p * row + 4 * vec + r % 4) % 32)
        worst = max(worst, max(banks.count(b) for b in set(banks)))
    return worst


@pytest.mark.parametrize("edge", [64, 128, 256])
@pytest.mark.parametrize("chunk, quads", [(8, False), (16, False), (8, True), (16, True)])
def test_swizzle_spreads_transposed_stores_as_the_pad_does(edge, chunk, quads):
    """Unpadded and swizzled, a warp's stores of an operand staged along K conflict no more than padded (at most
    2-way); unpadded and not swizzled, a chunk of 16 would store 16-way (elements) or 4-way (quads)."""
    padded = _store_banks(edge, chunk, True, quads)
    assert _store_banks(edge, chunk, False, quads) <= padded <= 2

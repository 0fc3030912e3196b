"""The matrix-vector kernel: one output row (m == 1) or column, K split over a few lanes per output and reduced in
the workgroup; ``matmul.matmul_kernel`` chooses it where the tiled kernel would leave its tiles mostly empty."""
from __future__ import annotations

from dataclasses import dataclass

from .matmul_common import (ENTRY, LINEAR_WORKGROUP, SYMBOLIC_CHOICE, _header, _pow2_ceil, _pow2_floor, _thread_count,
                            fold_grid)
from .sizes import ceil_div, is_size

# gemv: lanes (threads splitting K for one output) are the power of two that gives each about GEMV_PER_LANE products
# (GEMV_PER_LANE_STRIDED where K is strided and the threads of a row follow the outputs), between 4 and
# GEMV_MAX_LANES, and fewer while outputs x lanes exceed GEMV_MAX_THREADS. A short run per lane keeps the loads of
# a small matrix in flight at once. H200, m = 1, weights rotated past the L2 cache, GB/s of the
# weight read, before (16 lanes for K in 257..4095) -> after: 1536 x 576 634 -> 784, 576 x 1536 391 -> 791,
# 720 x 2048 527 -> 1176, 1000 x 2048 720 -> 1487, 49152 x 576 3565 -> 3542; x @ w 1024 (strided K) 552 -> 736.
# Minimal-batch inference, GPU ms per call, before -> after in one run: SmolLM2 2.26 -> 1.89,
# SmolVLA expert 1.38 -> 1.16.
GEMV_PER_LANE = 8
GEMV_PER_LANE_STRIDED = 16
GEMV_MAX_LANES = 128
GEMV_MAX_THREADS = 1 << 21
GEMV_UNROLL = 8               # gemv: products a lane loads before adding them up
# The gemv by groups (``width``: a half precision matrix read 8 elements to a vec4<u32> load, 16 bytes as a vec4 of
# f32 would be): lanes as above over groups instead of elements, about GEMV_GROUPS_PER_LANE groups each, and a lane
# loads GEMV_WIDE_UNROLL groups before adding them up (32 bytes of the matrix in flight per lane, as GEMV_UNROLL
# f32 elements are).
GEMV_GROUPS_PER_LANE = 2
GEMV_WIDE_UNROLL = 2
# A staged row (``staged``) is computed once per workgroup, K elements of work (a normalised row: loads, a square
# root, roundings to bfloat16) against K products per output: a workgroup of at least this many outputs keeps that
# below an eighth of its work. With 2 outputs a workgroup (128 lanes over K = 2048), the computed vector of
# Llama-3.2-1B's bfloat16 head cost more than its weights' bytes (H100: 452 us for 525 MB).
STAGED_MIN_COLUMNS = 8


@dataclass(frozen=True)
class GemvPlan:
    columns: int       # outputs per workgroup
    lanes: int         # threads splitting K for one output
    out_fastest: bool  # thread order: neighbouring threads take neighbouring outputs (else neighbouring p)


# ---------------------------------------------------------------- gemv


def _choose_gemv_plan(outputs, k: int, threads: int, out_fastest: bool, per_lane: int | None = None,
                      pairs: bool = False, min_columns: int = 1) -> GemvPlan:
    """The plan of a gemv of ``outputs`` dot products over ``k`` terms (elements, or groups of them read at once, about
    ``per_lane`` to a lane); with ``pairs`` (``outputs`` even), an even number of outputs per workgroup; at least
    ``min_columns`` outputs a workgroup where there are that many."""
    if per_lane is None:
        per_lane = GEMV_PER_LANE_STRIDED if out_fastest else GEMV_PER_LANE
    k = SYMBOLIC_CHOICE["k"] if is_size(k) else k  # (a symbolic K counts as a long one)
    lanes = max(4, min(GEMV_MAX_LANES, threads // (2 if pairs else 1), threads // min_columns,
                       _pow2_floor(k // per_lane)))
    if is_size(outputs):  # symbolic: one plan for every count
        return GemvPlan(threads // lanes, lanes, out_fastest)
    while lanes > 32 and outputs * lanes > GEMV_MAX_THREADS:
        lanes //= 2
    columns = min(threads // lanes, _pow2_ceil(outputs))  # (few outputs: the spare threads join the lanes)
    if pairs and columns % 2:  # (lanes of half the threads at most leave two: a pair's outputs in one workgroup)
        raise ValueError(f"matmul_kernel: a gemv storing pairs needs an even count of outputs a workgroup, "
                         f"got {columns} of {outputs}")
    return GemvPlan(columns, threads // columns, out_fastest)


def _gemv_lane(plan: GemvPlan, operands: tuple[str, ...]) -> str:
    """The lane's share of the dot products, every ``plan.lanes``-th p from its own (the ``operands``' loads,
    formatted with ``p``: the vector's, then each matrix's, summed into ``acc``, ``acc1``, ...): GEMV_UNROLL products
    loaded first (in flight together), then added in the plain loop's order, and the rest one by one."""
    steps = [f"p + {u * plan.lanes}u" if u else "p" for u in range(GEMV_UNROLL)]
    vector, matrices = operands[0], operands[1:]
    names = ["y"] + [f"y{k}_" for k in range(1, len(matrices))]
    accs = _accumulators(len(matrices))
    loads = "\n".join(f"            let x{u} = {vector.format(p=q)};" + "".join(
        f"\n            let {y}{u} = {o.format(p=q)};" for y, o in zip(names, matrices)) for u, q in enumerate(steps))
    fmas = "\n".join(f"            {acc} = fma(x{u}, {y}{u}, {acc});"
                     for u in range(GEMV_UNROLL) for y, acc in zip(names, accs))
    if len(matrices) == 1:
        single = f"            acc = fma({vector.format(p='p')}, {matrices[0].format(p='p')}, acc);"
    else:
        single = f"            let x = {vector.format(p='p')};\n" + "\n".join(
            f"            {acc} = fma(x, {o.format(p='p')}, {acc});" for o, acc in zip(matrices, accs))
    return f"""        var p = lane;
        for (; p + {(GEMV_UNROLL - 1) * plan.lanes}u < K; p += {GEMV_UNROLL * plan.lanes}u) {{
{loads}
{fmas}
        }}
        for (; p < K; p += {plan.lanes}u) {{
{single}
        }}"""


def _gemv_wide_lane(plan: GemvPlan, operands: tuple[str, ...], width: int) -> str:
    """``_gemv_lane`` by groups of ``width`` elements along K: the lane's every ``plan.lanes``-th group c from its own
    (the ``operands``' group loaders, formatted with ``p``: the vector's, then each matrix's), GEMV_WIDE_UNROLL
    groups loaded before they are added up, each group's products summed by vec4 dot products."""
    vector, matrices = operands[0], operands[1:]
    accs = _accumulators(len(matrices))
    steps = [f"c + {u * plan.lanes}u" if u else "c" for u in range(GEMV_WIDE_UNROLL)]

    def group(step: str, suffix: str) -> tuple[str, str]:
        loads = f"            let x{suffix} = {vector.format(p=step)};" + "".join(
            f"\n            let y{j}_{suffix} = {o.format(p=step)};" for j, o in enumerate(matrices))
        sums = "\n".join(f"            {acc} = {acc} + {_group_dot(f'x{suffix}', f'y{j}_{suffix}', width)};"
                         for j, acc in enumerate(accs))
        return loads, sums

    unrolled = [group(step, str(u)) for u, step in enumerate(steps)]
    single = group("c", "")
    return f"""        var c = lane;
        for (; c + {(GEMV_WIDE_UNROLL - 1) * plan.lanes}u < GROUPS; c += {GEMV_WIDE_UNROLL * plan.lanes}u) {{
{chr(10).join(loads for loads, _ in unrolled)}
{chr(10).join(sums for _, sums in unrolled)}
        }}
        for (; c < GROUPS; c += {plan.lanes}u) {{
{single[0]}
{single[1]}
        }}"""


def _group_dot(x: str, y: str, width: int) -> str:
    """The sum of the products of two groups of ``width`` elements (``kernels.prelude.GROUP_TYPE``)."""
    if width == 4:
        return f"dot({x}, {y})"
    return " + ".join(f"dot({x}[{q}], {y}[{q}])" for q in range(width // 4))


def gemv_stage_fits(k, products: int, limits: dict) -> bool:
    """Whether a gemv over columns with K ``k`` and ``products`` further products may stage A's row (``staged``): a
    concrete K whose row fits the workgroup storage beside the reduction's arrays."""
    threads = _thread_count(limits)
    return (not is_size(k) and k > 0
            and 4 * (k + threads * (1 + products)) <= limits.get("max-compute-workgroup-storage-size", 16384))


def _stage_row(threads: int) -> str:
    """WGSL: the workgroup computes A's row into ``row_a`` (every thread a share of K), before any lane reads it."""
    return f"""    if (live) {{
        for (var p = lid; p < K; p += {threads}u) {{ row_a[p] = load_a(batch_index, 0u, p); }}
    }}
    workgroupBarrier();
"""


def _gemv_operands(by_column: bool, width: int, matrices: int, staged: bool = False) -> tuple[str, ...]:
    """The loads of a gemv lane (formatted with ``p``: an element along K, or a group's number with ``width``): the
    vector's (from the staged row ``row_a`` where ``staged``), then each of the ``matrices``' (over rows: one)."""
    if staged:
        if width:
            elements = [f"row_a[{width}u * ({{p}}) + {q}u]" for q in range(width)]
            vector = ", ".join(f"vec4<f32>({', '.join(elements[q:q + 4])})" for q in range(0, width, 4))
            vector = vector if width == 4 else f"array<vec4<f32>, {width // 4}>({vector})"
        else:
            vector = "row_a[{p}]"
        return (vector, *_gemv_operands(by_column, width, matrices)[1:])
    if width:
        return (f"load_a{width}(batch_index, 0u, {{p}})", f"load_b{width}(batch_index, out_index, {{p}})",
                *(f"load_b{j}_{width}(batch_index, out_index, {{p}})" for j in range(1, matrices)))
    if by_column:
        return ("load_a(batch_index, 0u, {p})", "load_b(batch_index, {p}, out_index)",
                *(f"load_b{j}(batch_index, {{p}}, out_index)" for j in range(1, matrices)))
    return "load_a(batch_index, out_index, {p})", "load_b(batch_index, {p}, 0u)"


def _accumulators(count: int) -> list[str]:
    """The names of a gemv's ``count`` accumulators: ``acc``, ``acc1``, ..."""
    return ["acc"] + [f"acc{k}" for k in range(1, count)]


def _row_prologue(phases: int, threads: int) -> str:
    """The statistics of A's row, one after another: each ``row_phase<k>`` summed over K by the whole workgroup
    (a tree over ``partial``) into ``row_stat<k>``, before any lane loads A (whose loader reads them). Every
    workgroup computes its row's statistics itself: K terms of a row that the dot products read anyway."""
    parts = []
    for k in range(phases):
        parts.append(f"""    var stat{k} = 0.0;
    if (live) {{
        for (var p = lid; p < K; p += {threads}u) {{ stat{k} = stat{k} + row_phase{k}(batch_index, 0u, p); }}
    }}
    partial[lid] = stat{k};
    workgroupBarrier();
    for (var span = {threads // 2}u; span > 0u; span = span / 2u) {{
        if (lid < span) {{ partial[lid] = partial[lid] + partial[lid + span]; }}
        workgroupBarrier();
    }}
    row_stat{k} = partial[0];
    workgroupBarrier();
""")
    return "".join(parts)


def _gemv_store(by_column: bool, shared: list[str], next_output: int) -> tuple[str, str]:
    """(which threads store, their store) of a gemv whose sums are in the workgroup arrays ``shared`` at each
    output's lane 0: each such thread its output; with ``next_output`` (pairs of columns: how many threads on the
    next output's lane 0 is), each even output's, with the next one's sums."""
    if next_output:
        sums = ", ".join(f"vec2<f32>({name}[lid], {name}[lid + {next_output}u])" for name in shared)
        return "lane == 0u && out_local % 2u == 0u", f"store_c2(batch_index, 0u, out_index, {sums});"
    if by_column:
        return "lane == 0u", f"store_c(batch_index, 0u, out_index, {', '.join(f'{name}[lid]' for name in shared)});"
    return "lane == 0u", "store_c(batch_index, out_index, 0u, partial[lid]);"


def _check_gemv(by_column: bool, k, limits: dict, contiguous_k: bool, products: int, width: int, pairs: bool,
                staged: bool) -> None:
    """Refuse a gemv request whose options its form cannot take (``_gemv_kernel``'s arguments)."""
    if width and (not by_column or not contiguous_k or is_size(k) or k % width):
        raise ValueError("matmul_kernel: a gemv by groups needs m == 1, K contiguous and a multiple of the group")
    if pairs and not by_column:
        raise ValueError("matmul_kernel: a gemv stores pairs of columns only over columns (m == 1)")
    if staged and not (by_column and gemv_stage_fits(k, products, limits)):
        raise ValueError("matmul_kernel: a staged row needs the gemv over columns and a K that fits the storage")


def _gemv_kernel(prelude: str, *, batch: int, m: int, n: int, k: int, threads: int, limits: dict,
                 contiguous_k: bool, products: int = 0, row_phases: int = 0,
                 width: int = 0, pairs: bool = False, staged: bool = False) -> tuple[str, tuple[int, int, int]]:
    # m == 1: outputs are columns j, the vector is A's row, the matrix is B.
    # n == 1: outputs are rows i, the vector is B's column, the matrix is A.
    # width > 0: over columns with K contiguous, by groups of width elements (``matmul_kernel``'s ``gemv_width``).
    # pairs: over columns, the thread of each even output stores it with the next one (``matmul_kernel``'s ``pairs``).
    # staged: over columns, A's row computed once per workgroup into ``row_a`` (``matmul_kernel``'s ``staged``).
    by_column = m == 1
    outputs = n if by_column else m
    _check_gemv(by_column, k, limits, contiguous_k, products, width, pairs, staged)
    min_columns = STAGED_MIN_COLUMNS if staged else 1
    plan = (_choose_gemv_plan(outputs, k // width, threads, False, GEMV_GROUPS_PER_LANE, pairs, min_columns)
            if width else _choose_gemv_plan(outputs, k, threads, not contiguous_k, pairs=pairs,
                                            min_columns=min_columns))
    accs = _accumulators(1 + products)
    if threads * 4 * len(accs) > limits["max-compute-workgroup-storage-size"]:
        raise ValueError("matmul_kernel: workgroup storage limit too small for the gemv reduction")
    blocks = ceil_div(outputs, plan.columns)
    total = batch * blocks
    grid = fold_grid(total, limits["max-compute-workgroups-per-dimension"])
    shared = ["partial"] + [f"partial{j}" for j in range(1, len(accs))]
    operands = _gemv_operands(by_column, width, len(accs), staged)
    if plan.out_fastest:  # neighbouring threads read neighbouring outputs (the matrix is contiguous along them)
        decode = f"let out_local = lid % {plan.columns}u;\n    let lane = lid / {plan.columns}u;"
        partner_step, next_output = plan.columns, 1
    else:                 # neighbouring threads read neighbouring p (the matrix is contiguous along K)
        decode = f"let lane = lid % {plan.lanes}u;\n    let out_local = lid / {plan.lanes}u;"
        partner_step, next_output = 1, plan.lanes
    stores, store = _gemv_store(by_column, shared, next_output if pairs else 0)
    declared = "".join(f"var<workgroup> {name}: array<f32, {threads}>;\n" for name in shared)
    declared += "".join(f"var<private> row_stat{j}: f32;\n" for j in range(row_phases))
    declared += f"var<workgroup> row_a: array<f32, {k}>;\n" if staged else ""
    kept = "\n    ".join(f"{name}[lid] = {acc};" for name, acc in zip(shared, accs))
    added = " ".join(f"{name}[lid] = {name}[lid] + {name}[lid + span * {partner_step}u];" for name in shared)

    kernel = f"""
// ---- matmul: gemv over {"columns" if by_column else "rows"}, {plan.columns} outputs x {plan.lanes} K lanes\
{f", groups of {width}" if width else ""}{", stored by pairs" if pairs else ""}
{_header(batch, m, n, k, grid, total, OUTPUTS=outputs, BLOCKS=blocks, **({"GROUPS": k // width} if width else {}))}\
{declared}
@compute @workgroup_size({threads})
fn main({ENTRY}) {{
{LINEAR_WORKGROUP}    let batch_index = wg_linear / BLOCKS;
{_row_prologue(row_phases, threads)}{_stage_row(threads) if staged else ""}    {decode}
    let out_index = (wg_linear % BLOCKS) * {plan.columns}u + out_local;
    let has_output = live && out_index < OUTPUTS;
    {"".join(f"var {acc} = 0.0;" + chr(10) + "    " for acc in accs)}if (has_output) {{
{_gemv_wide_lane(plan, operands, width) if width else _gemv_lane(plan, operands)}
    }}
    {kept}
    workgroupBarrier();
    for (var span = {plan.lanes // 2}u; span > 0u; span = span / 2u) {{
        if (lane < span) {{ {added} }}
        workgroupBarrier();
    }}
    if (has_output && {stores}) {{ {store} }}
}}
"""
    return prelude + kernel, grid

"""The tiled matmul kernel's staging: WGSL that fetches a K chunk of an operand into registers and stores it into
shared memory, and the range checks a tile needs (each left out where the shape makes it always true).

Shared-memory layout (both operands): K-major, one row of ``shared_row(edge)`` vec4s per K step holding the tile's
``edge`` rows of A (so A is stored transposed) or columns of B, plus SHARED_PAD_VEC4 vec4 of padding. The products
read one vec4 per 4 rows (columns) per K step, a quarter-warp's 8 threads 8 neighbouring vec4s or one broadcast
vec4: no bank conflicts. The stores:
- element staging (the default): each thread stages single elements, the operand's unit-stride axis fastest across
  threads (coalesced loads), and stores each as one component of a vec4. Where that axis is K (A row-major, B
  column-major) a warp stores 32 transposed elements: thread e at K step e % chunk, row e / chunk; the pad shifts
  each K step by 4 banks, which makes them conflict-free for chunks of 8 (2-way at 16). An unpadded plan
  (``TiledPlan.padded`` false: two buffers in a storage limit that the pad would pass) swizzles such an operand
  instead: at K step p, row vec4 v lies at v ^ (p % SWIZZLE_SPAN) (``swizzled``), which spreads the K steps over
  banks as the pad did (unswizzled, a chunk of 16 would store 16-way) at no cost in storage; the products' reads
  XOR their index by the step's constant.
- quad staging (``TiledPlan.quads``): each thread stages 4 neighbouring elements along the unit-stride axis (the
  loads of a thread adjacent, its index math done once per 4); along the tile's edge (A column-major, B row-major)
  they go into shared memory as one vec4 store, along K as 4 component stores (conflict-free for a chunk of 8).
  Where the prelude defines a vec4 loader for the operand (``load_a4`` / ``load_b4``: a plain f32 or half precision
  operand whose rows along that axis are whole quads, read through a binding of its value as vec4s of f32 or
  vec2<u32>s of halves) the 4 are one load; else 4 scalar loads through ``load_a`` / ``load_b``, correct for any
  layout, gather, offset and stride."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .matmul_plans import TiledPlan

SHARED_PAD_VEC4 = 1  # vec4s of padding per shared-tile row: transposed stores spread over banks


def shared_row(edge: int, padded: bool = True) -> int:
    """vec4s per K step of a tile's operand in shared memory: ``edge`` rows (or columns), padded unless a plan says
    otherwise (``TiledPlan.padded``)."""
    return edge // 4 + (SHARED_PAD_VEC4 if padded else 0)


QUAD = 4  # elements a thread stages together under quad staging: one vec4 register
SWIZZLE_SPAN = 8  # vec4s: an unpadded row's K step XORs the vec4 index of an operand staged along K in groups of this


def swizzle_span(edge: int) -> int:
    """The span of the XOR (see the module docstring) in a shared row of ``edge`` rows or columns: SWIZZLE_SPAN, or
    the largest power of two below it that divides the row's vec4s (rows of whole spans keep each index in its
    row)."""
    span = SWIZZLE_SPAN
    while (edge // 4) % span:
        span //= 2
    return span


def swizzled(index: str, step: str, span: int) -> str:
    """WGSL of the vec4 ``index`` of a shared row at K step ``step`` (WGSL) where the row is swizzled in ``span``s
    (0: not swizzled)."""
    return f"(({index}) ^ (({step}) % {span}u))" if span else index


class Staging:
    """WGSL that fetches one K chunk of A (or B) from memory into registers and stores it into shared memory.

    Each thread takes units ``lid + t * threads`` (an element each, or under quad staging 4 neighbouring ones along
    ``fast``); ``fast`` names the operand's unit-stride axis, which varies fastest across threads so that the fetch
    is coalesced. An operand fetched in a loop (``looped``) keeps element staging."""

    def __init__(self, plan: TiledPlan, a_side: bool, fast: str, looped: bool = False, vector: bool = False):
        self.plan, self.a_side, self.looped = plan, a_side, looped
        self.edge = plan.tile_m if a_side else plan.tile_n
        self.total = self.edge * plan.chunk_k
        self.quads = plan.quads and not looped
        self.width = QUAD if self.quads else 1  # elements per unit
        self.units = self.total // self.width
        self.count = -(-self.units // plan.threads)
        self.name = "a" if a_side else "b"
        self.along_k = fast == "p"  # p varies fastest across threads
        self.vector = vector and self.quads  # a quad is one call of the prelude's vec4 loader
        # unpadded rows of an operand stored along K: the vec4 index XORed with the K step (module docstring)
        self.swizzle = swizzle_span(self.edge) if self.along_k and not plan.padded else 0

    def _decode(self, t: int) -> str:
        """``p{t}`` and ``r{t}``: the K step and row (column) of unit t's first element."""
        chunk, edge, w = self.plan.chunk_k // self.width, self.edge // self.width, self.width
        e = f"(lid + {t * self.plan.threads}u)"
        scale = f"{w}u * " if w > 1 else ""
        if self.along_k:
            return f"let p{t} = {scale}({e} % {chunk}u);\n        let r{t} = {e} / {chunk}u;"
        return f"let r{t} = {scale}({e} % {edge}u);\n        let p{t} = {e} / {edge}u;"

    def _partial_unit(self, t: int) -> bool:
        """Whether unit t lies past the chunk for some threads (the units do not divide evenly)."""
        return (t + 1) * self.plan.threads > self.units

    def declare(self) -> str:
        zero = "vec4<f32>()" if self.quads else "0.0"
        return "\n".join(f"    var stage_{self.name}{t} = {zero};" for t in range(self.count))

    def fetch(self, k0: str, checks: "Checks") -> str:
        """Load the chunk at ``k0`` into the staging registers (zero where out of range)."""
        if self.looped:
            return self._fetch_loop(k0, checks)
        if self.vector:
            return self._fetch_vectors(k0, checks)
        if self.quads:
            return self._fetch_quads(k0, checks)
        lines = []
        for t in range(self.count):
            reg = f"stage_{self.name}{t}"
            conds = []
            if self._partial_unit(t):
                conds.append(f"lid + {t * self.plan.threads}u < {self.units}u")
            if checks.live:
                conds.append("live")
            edge = "row0 + r{t} < M" if self.a_side else "col0 + r{t} < N"
            if (checks.rows if self.a_side else checks.cols):
                conds.append(edge.format(t=t))
            if checks.k:
                conds.append(f"{k0} + p{t} < k_end")
            load = (f"load_a(batch_index, row0 + r{t}, {k0} + p{t})" if self.a_side else
                    f"load_b(batch_index, {k0} + p{t}, col0 + r{t})")
            lines.append(self._guarded_load(t, reg, load, conds, "0.0"))
        return "\n".join(lines)

    def _guarded_load(self, t: int, reg: str, load: str, conds: list[str], zero: str) -> str:
        """Thread ``t``'s load into ``reg``, ``zero`` where any of ``conds`` (the tile's edges) fails."""
        body = f"{reg} = {load};"
        if conds:
            body = f"{reg} = {zero};\n        if ({' && '.join(conds)}) {{ {body} }}"
        return f"""    {{
        {self._decode(t)}
        {body}
    }}"""

    def _fetch_quads(self, k0: str, checks: "Checks") -> str:
        """``fetch`` under quad staging: each unit's 4 elements loaded one by one, each range-checked where the
        shape needs it (the row check once where the 4 lie along K, the K check once where they lie along the
        edge), into one vec4 register."""
        lines = []
        edge_bound = "M" if self.a_side else "N"
        origin = "row0" if self.a_side else "col0"
        for t in range(self.count):
            reg, shared, loads = f"stage_{self.name}{t}", [], []
            if self._partial_unit(t):
                shared.append(f"lid + {t * self.plan.threads}u < {self.units}u")
            if checks.live:
                shared.append("live")
            for q in range(QUAD):
                p, r = (f"p{t} + {q}u", f"r{t}") if self.along_k else (f"p{t}", f"r{t} + {q}u")
                conds = []
                if checks.rows if self.a_side else checks.cols:
                    conds.append(f"{origin} + {r} < {edge_bound}")
                if checks.k:
                    conds.append(f"{k0} + {p} < k_end")
                load = (f"load_a(batch_index, row0 + {r}, {k0} + {p})" if self.a_side else
                        f"load_b(batch_index, {k0} + {p}, col0 + {r})")
                body = f"{reg}[{q}] = {load};"
                loads.append(f"        if ({' && '.join(conds)}) {{ {body} }}" if conds else f"        {body}")
            inner = "\n".join(loads)
            if shared:
                inner = f"        if ({' && '.join(shared)}) {{\n{inner}\n        }}"
            lines.append(f"""    {{
        {self._decode(t)}
        {reg} = vec4<f32>();
{inner}
    }}""")
        return "\n".join(lines)

    def _fetch_vectors(self, k0: str, checks: "Checks") -> str:
        """``fetch`` under quad staging through the prelude's ``load_a4`` / ``load_b4`` (vec4 number c4 along the
        unit-stride axis, at the other axis' coordinate): a quad starts at a multiple of 4 and the axis is whole
        quads long (the prelude's promise), so its first element's range checks hold for all 4."""
        lines = []
        origin, edge_bound = ("row0", "M") if self.a_side else ("col0", "N")
        for t in range(self.count):
            reg = f"stage_{self.name}{t}"
            conds = [f"lid + {t * self.plan.threads}u < {self.units}u"] if self._partial_unit(t) else []
            conds += ["live"] if checks.live else []
            if checks.rows if self.a_side else checks.cols:
                conds.append(f"{origin} + r{t} < {edge_bound}")
            if checks.k:
                conds.append(f"{k0} + p{t} < k_end")
            if self.along_k:
                load = f"load_{self.name}4(batch_index, {origin} + r{t}, ({k0} + p{t}) / 4u)"
            else:
                load = f"load_{self.name}4(batch_index, {k0} + p{t}, ({origin} + r{t}) / 4u)"
            lines.append(self._guarded_load(t, reg, load, conds, "vec4<f32>()"))
        return "\n".join(lines)

    def _fetch_loop(self, k0: str, checks: "Checks") -> str:
        """``fetch`` as one loop over the staging registers (a switch writes each), so that the operand's loader,
        a chain over sibling tensors, is written once rather than once per register."""
        plan, e = self.plan, f"(lid + t * {self.plan.threads}u)"
        decode = (f"let p = {e} % {plan.chunk_k}u;\n        let r = {e} / {plan.chunk_k}u;" if self.along_k else
                  f"let r = {e} % {self.edge}u;\n        let p = {e} / {self.edge}u;")
        conds = [f"{e} < {self.total}u"] if self.count * plan.threads > self.total else []
        conds += ["live"] if checks.live else []
        if checks.rows if self.a_side else checks.cols:
            conds.append("row0 + r < M" if self.a_side else "col0 + r < N")
        conds += [f"{k0} + p < k_end"] if checks.k else []
        load = (f"load_a(batch_index, row0 + r, {k0} + p)" if self.a_side else
                f"load_b(batch_index, {k0} + p, col0 + r)")
        fetch = f"if ({' && '.join(conds)}) {{ v = {load}; }}" if conds else f"v = {load};"
        cases = "\n".join(f"            case {t}u: {{ stage_{self.name}{t} = v; }}" for t in range(self.count))
        return f"""    for (var t = 0u; t < {self.count}u; t++) {{
        {decode}
        var v = 0.0;
        {fetch}
        switch t {{
{cases}
            default: {{}}
        }}
    }}"""

    def store(self, element: str, base: str = "") -> str:
        """Store the staging registers into shared memory (``base``: WGSL text ending in " + ", the offset of the
        buffer written in a double-buffered kernel)."""
        row = shared_row(self.edge, self.plan.padded)
        lines = []
        for t in range(self.count):
            reg = f"stage_{self.name}{t}"
            guard = f"if (lid + {t * self.plan.threads}u < {self.units}u) " if self._partial_unit(t) else ""
            if not self.quads:
                value = reg if element == "f32" else f"{element}({reg})"
                column = swizzled(f"r{t} / 4u", f"p{t}", self.swizzle)
                stores = f"tile_{self.name}[{base}p{t} * {row}u + {column}][r{t} % 4u] = {value};"
            elif self.along_k:  # 4 K steps of one row: a component of 4 shared rows
                stores = "\n        ".join(
                    f"tile_{self.name}[{base}(p{t} + {q}u) * {row}u + "
                    f"{swizzled(f'r{t} / 4u', f'p{t} + {q}u', self.swizzle)}][r{t} % 4u] = "
                    + (f"{reg}[{q}];" if element == "f32" else f"{element}({reg}[{q}]);") for q in range(QUAD))
            else:  # 4 neighbouring rows of one K step: one vec4 of shared memory (r{t} is a multiple of 4)
                value = reg if element == "f32" else f"vec4<{element}>({reg})"
                stores = f"tile_{self.name}[{base}p{t} * {row}u + r{t} / 4u] = {value};"
            lines.append(f"""    {guard}{{
        {self._decode(t)}
        {stores}
    }}""")
        return "\n".join(lines)


@dataclass(frozen=True)
class Checks:
    """The range checks a tiled kernel needs: each is left out where the shape makes it always true."""
    live: bool  # the grid was folded and rounded up: some workgroups have no tile
    rows: bool  # M is not a multiple of the tile's rows
    cols: bool  # N is not a multiple of the tile's columns
    k: bool     # some K slice does not end on a whole chunk

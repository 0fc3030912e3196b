"""The tiled matmul kernel's staging: WGSL that fetches a K chunk of an operand into registers and stores it into
shared memory, and the range checks a tile needs (each left out where the shape makes it always true)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .matmul import TiledPlan

SHARED_PAD_VEC4 = 1  # vec4s of padding per shared-tile row: transposed stores spread over banks


def shared_row(edge: int) -> int:
    """vec4s per K step of a tile's operand in shared memory: ``edge`` rows (or columns), padded."""
    return edge // 4 + SHARED_PAD_VEC4


class Staging:
    """WGSL that fetches one K chunk of A (or B) from memory into registers and stores it into shared memory.

    Each thread takes elements ``lid + t * threads``; ``fast`` names the operand's unit-stride axis, which
    varies fastest across threads so that the fetch is coalesced."""

    def __init__(self, plan: TiledPlan, a_side: bool, fast: str, looped: bool = False):
        self.plan, self.a_side, self.looped = plan, a_side, looped
        self.edge = plan.tile_m if a_side else plan.tile_n
        self.total = self.edge * plan.chunk_k
        self.count = -(-self.total // plan.threads)
        self.name = "a" if a_side else "b"
        self.along_k = fast == "p"  # p varies fastest across threads

    def _decode(self, t: int) -> str:
        chunk, e = self.plan.chunk_k, f"(lid + {t * self.plan.threads}u)"
        if self.along_k:
            return f"let p{t} = {e} % {chunk}u;\n        let r{t} = {e} / {chunk}u;"
        return f"let r{t} = {e} % {self.edge}u;\n        let p{t} = {e} / {self.edge}u;"

    def declare(self) -> str:
        return "\n".join(f"    var stage_{self.name}{t} = 0.0;" for t in range(self.count))

    def fetch(self, k0: str, checks: "Checks") -> str:
        """Load the chunk at ``k0`` into the staging registers (zero where out of range)."""
        if self.looped:
            return self._fetch_loop(k0, checks)
        lines = []
        for t in range(self.count):
            reg = f"stage_{self.name}{t}"
            conds = []
            if (t + 1) * self.plan.threads > self.total:
                conds.append(f"lid + {t * self.plan.threads}u < {self.total}u")
            if checks.live:
                conds.append("live")
            edge = "row0 + r{t} < M" if self.a_side else "col0 + r{t} < N"
            if (checks.rows if self.a_side else checks.cols):
                conds.append(edge.format(t=t))
            if checks.k:
                conds.append(f"{k0} + p{t} < k_end")
            load = (f"load_a(batch_index, row0 + r{t}, {k0} + p{t})" if self.a_side else
                    f"load_b(batch_index, {k0} + p{t}, col0 + r{t})")
            body = f"{reg} = {load};"
            if conds:
                body = f"{reg} = 0.0;\n        if ({' && '.join(conds)}) {{ {body} }}"
            lines.append(f"""    {{
        {self._decode(t)}
        {body}
    }}""")
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
        row = shared_row(self.edge)
        lines = []
        for t in range(self.count):
            value = f"stage_{self.name}{t}" if element == "f32" else f"{element}(stage_{self.name}{t})"
            guard = (f"if (lid + {t * self.plan.threads}u < {self.total}u) "
                     if (t + 1) * self.plan.threads > self.total else "")
            lines.append(f"""    {guard}{{
        {self._decode(t)}
        tile_{self.name}[{base}p{t} * {row}u + r{t} / 4u][r{t} % 4u] = {value};
    }}""")
        return "\n".join(lines)


@dataclass(frozen=True)
class Checks:
    """The range checks a tiled kernel needs: each is left out where the shape makes it always true."""
    live: bool  # the grid was folded and rounded up: some workgroups have no tile
    rows: bool  # M is not a multiple of the tile's rows
    cols: bool  # N is not a multiple of the tile's columns
    k: bool     # some K slice does not end on a whole chunk

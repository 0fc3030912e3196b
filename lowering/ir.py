"""The typed static graph: values with fixed shapes and dtypes, produced by archetype nodes.

Node kinds (the archetypes):
  ``Input``     a graph input (role ``input``) or a long-lived parameter/buffer (role ``param``);
  ``Pointwise`` one output element per thread, ``expr`` over output coordinates and loads of other values;
                views (permute, slice, expand, reshape...) are Pointwise nodes whose expr is a single load;
                ``also`` holds expressions of further outputs of the same size, stored at the same linear index;
  ``Reduce``    a row program: for each row of ``domain`` (the non-reduced axes) it runs ``phases``, each
                a reduction (sum/prod/max/min/argmax/argmin, or sum2: an accurate sum) of an expression that may
                use the results of earlier phases (``acc(i)``), then writes row outputs and/or element outputs;
  ``Matmul``    C[b, i, j] = sum_p A[b, i, p] * B[b, p, j], operands given as expressions over (b, i, p) and
                (b, p, j), with an epilogue over (b, i, j) and ``acc(0)``; ``more_blocks`` holds further outputs
                that share A (each a block of columns with its own B and epilogue) or B (blocks of rows);
  ``Attention`` fused scaled-dot-product attention (a forward or a backward pass), operands as expressions;
  ``Scatter``   an update stored over the input it updates, run over the elements it changes (``regions``).

Loads inside expressions name a value id and one coordinate per dimension of that value; nothing here
knows about memory layout until the planner assigns buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import expr as E

# Logical dtype -> the dtype its expressions compute in: every float in f32 (half precisions are widened on load and
# rounded only where a value is stored in half precision or cast to it).
LOGICAL_TO_COMPUTE = {"float32": E.F32, "bfloat16": E.F32, "float16": E.F32, "int64": E.I32, "int32": E.I32,
                      "bool": E.BOOL}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
REDUCE_OPS = ("sum", "prod", "max", "min", "argmax", "argmin", "sum2")


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class Value:
    id: int
    shape: tuple[int, ...]
    dtype: str  # logical: a key of LOGICAL_TO_COMPUTE

    @property
    def compute_dtype(self) -> str:
        return LOGICAL_TO_COMPUTE[self.dtype]

    @property
    def numel(self) -> int:
        return numel(self.shape)


@dataclass
class Node:
    outs: list[Value]
    # Its outputs placed side by side in the arena, so that a kernel reading several binds them once (``packed``).
    side_by_side: bool = field(default=False, kw_only=True)

    @property
    def out(self) -> Value:
        return self.outs[0]

    def exprs(self) -> list[E.Expr]:
        """Every expression of the node that may load other values."""
        return []

    def domains(self) -> list[tuple[int, ...]]:
        """The iteration shape over which each expression of ``exprs()`` is evaluated."""
        return []

    def set_exprs(self, exprs: list[E.Expr]) -> None:
        """Replace the node's expressions (same order as ``exprs()``)."""


@dataclass
class Input(Node):
    name: str = ""
    role: str = "input"  # input | param


@dataclass
class Region:
    """The elements that an update of an input changes: for each coordinate of ``shape``, the output coordinates
    ``at`` it lands at, and each output's new value there (``values``, in the order of the node's outputs), stored
    where ``keep`` holds (of several entries landing on one element, the one the update takes). Everywhere else the
    outputs equal ``bases`` (the value ids of the inputs they update, one an output). All are expressions over the
    region's coordinates. A pointwise update carries it beside its expressions (a scatter's into a KV cache:
    ``index_put``); where its outputs are stored over their bases, the update runs over the region (``regions``)."""

    shape: tuple[int, ...]
    at: tuple[E.Expr, ...]
    keep: E.Expr
    values: list[E.Expr]
    bases: list[int]

    def exprs(self) -> list[E.Expr]:
        return [*self.at, self.keep, *self.values]

    def with_exprs(self, exprs: list[E.Expr]) -> "Region":
        """The region with its expressions replaced (same order as ``exprs()``)."""
        n = len(self.at)
        return Region(self.shape, tuple(exprs[:n]), exprs[n], list(exprs[n + 1:]), self.bases)


@dataclass
class Pointwise(Node):
    expr: E.Expr = None
    label: str = ""
    also: list[E.Expr] = field(default_factory=list)  # outs[1:], over the coordinates of outs[0]
    region: Region | None = None  # the elements the node changes where it updates an input (``Region``)

    def exprs(self):
        return [self.expr, *self.also, *(self.region.exprs() if self.region else ())]

    def domains(self):
        own = [self.out.shape] * (1 + len(self.also))
        return own + ([self.region.shape] * len(self.region.exprs()) if self.region else [])

    def set_exprs(self, exprs):
        """(The node's own expressions may grow in number: ``multi_output`` adds outputs so.)"""
        n = len(exprs) - (len(self.region.exprs()) if self.region else 0)
        self.expr, *self.also = exprs[:n]
        if self.region is not None:
            self.region = self.region.with_exprs(exprs[n:])

    def is_view(self) -> bool:
        return self.expr.op == "load" and not self.also and self.region is None


@dataclass
class RowOutput:
    """An output of a Reduce node: per row (shape = non-reduced axes) or per element (shape = domain)."""

    per_element: bool
    expr: E.Expr


@dataclass
class Reduce(Node):
    domain: tuple[int, ...] = ()
    axes: tuple[int, ...] = ()
    phases: list[tuple[str, E.Expr]] = field(default_factory=list)
    results: list[RowOutput] = field(default_factory=list)  # one per out value, same order
    label: str = ""

    def exprs(self):
        return [e for _, e in self.phases] + [r.expr for r in self.results]

    def domains(self):
        return [self.domain] * (len(self.phases) + len(self.results))

    def set_exprs(self, exprs):
        n = len(self.phases)
        self.phases = [(op, e) for (op, _), e in zip(self.phases, exprs[:n])]
        self.results = [RowOutput(r.per_element, e) for r, e in zip(self.results, exprs[n:])]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(s for d, s in enumerate(self.domain) if d not in self.axes)

    @property
    def row_length(self) -> int:
        return numel(tuple(self.domain[a] for a in self.axes))


@dataclass
class MatmulBlock:
    """A further block of a Matmul's outputs, after the first output and any earlier blocks: a sibling matmul merged
    in because it shares an operand. Along ``Matmul.block_axis`` "j" it adds ``size`` columns with its own B (the
    siblings share A); along "i" it adds ``size`` rows with its own A (they share B)."""

    size: int
    operand: E.Expr  # B over (b, p, j within the block), or A over (b, i within the block, p)
    epilogue: E.Expr  # over (b, i, j), the blocked coordinate counted within the block, and acc(0)


@dataclass
class Matmul(Node):
    batch: int = 1
    m: int = 1
    n: int = 1
    k: int = 1
    a: E.Expr = None  # over coord(0)=b, coord(1)=i, coord(2)=p
    b: E.Expr = None  # over coord(0)=b, coord(1)=p, coord(2)=j
    epilogue: E.Expr = None  # over coord(0)=b, coord(1)=i, coord(2)=j and acc(0)
    label: str = ""
    more_blocks: list[MatmulBlock] = field(default_factory=list)  # outs[1:], one block each
    block_axis: str = "j"  # along which the outputs lie side by side: "j" (columns) or "i" (rows)
    # Further B operands over (b, p, j), each summed against A like ``b``: the epilogue reads their sums as acc(1),
    # acc(2), ... (a consumer of two products of one vector: SwiGLU's silu(x @ gate) * (x @ up); paired_matmuls.py).
    products: list[E.Expr] = field(default_factory=list)
    # A row-wise prologue: sums over p of expressions over (b, i, p), each of which may read the earlier ones' sums
    # as acc(k); ``a`` reads their sums as acc(0), acc(1), ... (a norm of A's row: RMS norm's sum of squares before
    # the projection; row_prologues.py). Only the matrix-vector kernel (one row) takes products or a prologue.
    row_phases: list[E.Expr] = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        """Extent of each output along ``block_axis``: the kernel computes their sum side by side."""
        return [self.n if self.block_axis == "j" else self.m] + [blk.size for blk in self.more_blocks]

    @property
    def rows(self) -> int:
        return sum(self.sizes) if self.block_axis == "i" else self.m

    @property
    def columns(self) -> int:
        return sum(self.sizes) if self.block_axis == "j" else self.n

    def exprs(self):
        """[a, b, epilogue, (operand, epilogue) of each further block, *products, *row_phases]."""
        return ([self.a, self.b, self.epilogue] + [e for blk in self.more_blocks for e in (blk.operand, blk.epilogue)]
                + self.products + self.row_phases)

    def domains(self):
        doms = [(self.batch, self.m, self.k), (self.batch, self.k, self.n), (self.batch, self.m, self.n)]
        for s in self.sizes[1:]:
            if self.block_axis == "j":
                doms += [(self.batch, self.k, s), (self.batch, self.m, s)]
            else:
                doms += [(self.batch, s, self.k), (self.batch, s, self.n)]
        doms += ([(self.batch, self.k, self.n)] * len(self.products)
                 + [(self.batch, self.m, self.k)] * len(self.row_phases))
        return doms

    def set_exprs(self, exprs):
        self.a, self.b, self.epilogue = exprs[:3]
        end = 3 + 2 * len(self.more_blocks)
        self.more_blocks = [MatmulBlock(blk.size, o, e)
                            for blk, o, e in zip(self.more_blocks, exprs[3:end:2], exprs[4:end:2])]
        self.products = list(exprs[end:end + len(self.products)])
        self.row_phases = list(exprs[end + len(self.products):])


ATTENTION_OPERANDS = ("q", "k", "v", "bias", "dout", "lse", "delta")


@dataclass
class Attention(Node):
    """Scaled dot-product attention without a stored score matrix, one pass of ``kind``:
    "forward" -> outs [out (batch, heads, lq, dv), lse (batch, heads, lq)] (lse left out where nothing reads it:
    ``fusion``); "grad_q" -> [dq (batch, heads, lq,
    d)]; "grad_kv" -> [dk (batch, kv_heads, lk, d), dv (batch, kv_heads, lk, dv)].

    Operands are expressions: q over (b, h, i, c), k and v over (b, h, j, c) with h the query head (grouped-query
    attention maps it to its KV head in the expression), the additive ``bias`` over (b, h, i, j), and for the
    backward passes dout over (b, h, i, c), lse and delta over (b, h, i). Unused operands are None.

    ``writes``: an update of the values the pass reads (a KV cache's new rows: a ``Scatter``, or a ``Pointwise``
    concatenation) whose stores its dispatch runs too, its outputs after the pass's own in ``outs``; the pass reads
    what the update stores from the update's own expressions (``attention_writes``)."""

    kind: str = "forward"
    batch: int = 1
    heads: int = 1
    kv_heads: int = 1
    lq: int = 1
    lk: int = 1
    d: int = 1
    dv: int = 1
    scale: float = 1.0
    causal: bool = False
    q: E.Expr = None
    k: E.Expr = None
    v: E.Expr = None
    bias: E.Expr | None = None
    dout: E.Expr | None = None
    lse: E.Expr | None = None
    delta: E.Expr | None = None
    label: str = "attention"
    writes: Pointwise | Scatter | None = None

    @property
    def own_outs(self) -> list[Value]:
        """The pass's own outputs: ``outs`` without those of ``writes``."""
        return self.outs[:len(self.outs) - len(self.writes.outs)] if self.writes is not None else self.outs

    def operands(self) -> list[str]:
        """Names of the operands this pass uses, in ``exprs()`` order."""
        return [name for name in ATTENTION_OPERANDS if getattr(self, name) is not None]

    def exprs(self):
        """The operands' expressions, then those of ``writes``."""
        return [getattr(self, name) for name in self.operands()] + (self.writes.exprs() if self.writes else [])

    def domains(self):
        b, h, lq, lk = self.batch, self.heads, self.lq, self.lk
        shapes = {"q": (b, h, lq, self.d), "k": (b, h, lk, self.d), "v": (b, h, lk, self.dv),
                  "bias": (b, h, lq, lk), "dout": (b, h, lq, self.dv), "lse": (b, h, lq), "delta": (b, h, lq)}
        return [shapes[name] for name in self.operands()] + (self.writes.domains() if self.writes else [])

    def set_exprs(self, exprs):
        names = self.operands()
        for name, e in zip(names, exprs):
            setattr(self, name, e)
        if self.writes is not None:
            self.writes.set_exprs(list(exprs[len(names):]))


@dataclass
class Scatter(Node):
    """An update that stores each output's ``region.values`` at ``region.at`` where ``region.keep`` holds, and
    nothing elsewhere: its outputs hold the rest already, each stored over its base (``regions`` makes it of a
    ``Pointwise`` whose outputs are)."""

    region: Region = None
    label: str = ""

    def exprs(self):
        return self.region.exprs()

    def domains(self):
        return [self.region.shape] * len(self.region.exprs())

    def set_exprs(self, exprs):
        self.region = self.region.with_exprs(exprs)


def storing_node(node: Node, vid: int) -> Node:
    """The node whose kernel code stores value ``vid`` of ``node``: the update an attention pass runs in its dispatch
    (``Attention.writes``) for that update's outputs, else ``node`` itself."""
    writes = getattr(node, "writes", None)
    return writes if writes is not None and any(v.id == vid for v in writes.outs) else node


def kernel_forms(node: Node, exprs: list[E.Expr] | None = None) -> list[list[E.Expr]]:
    """The groups of ``node``'s expressions (or of ``exprs``, replacements in ``exprs()`` order) that are each a whole
    kernel's: a pointwise update with a region runs over its output or over its region (``regions``), never both;
    any other node is one group. A kernel's bindings are those of its largest group."""
    exprs = node.exprs() if exprs is None else exprs
    if isinstance(node, Pointwise) and node.region is not None:
        own = len(exprs) - len(node.region.exprs())
        return [exprs[:own], exprs[own:]]
    return [exprs]


def last_reads(nodes: list[Node]) -> dict[int, int]:
    """Value id -> index in ``nodes`` of the last node that loads it."""
    last: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for e in node.exprs():
            for ld in E.loads_of(e):
                last[ld.args[0]] = i
    return last


@dataclass
class Graph:
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    status_messages: dict[int, str] = field(default_factory=dict)  # code raised by ``check`` exprs -> error
    in_place: dict[int, str] = field(default_factory=dict)  # output position -> Input it may overwrite (in_place.py)

    def position(self, node: Node) -> int:
        """Where ``node`` is in ``nodes``, found by identity (a dataclass's ``==``, which ``list.index`` asks of each
        node before it, compares every field)."""
        return next(i for i, n in enumerate(self.nodes) if n is node)

    def remove(self, node: Node) -> None:
        """Drop ``node`` from ``nodes`` (found by identity: ``position``)."""
        del self.nodes[self.position(node)]

    def producers(self) -> dict[int, Node]:
        return {v.id: n for n in self.nodes for v in n.outs}

    def users(self) -> dict[int, list[Node]]:
        """Value id -> nodes whose expressions load it (each node once)."""
        users: dict[int, list[Node]] = {}
        for n in self.nodes:
            seen = set()
            for e in n.exprs():
                for ld in E.loads_of(e):
                    vid = ld.args[0]
                    if vid not in seen:
                        seen.add(vid)
                        users.setdefault(vid, []).append(n)
        return users

    def describe(self) -> str:
        """A readable listing, one node per line (for debugging and explain)."""
        lines = []
        for n in self.nodes:
            outs = ", ".join(f"v{v.id}:{v.dtype}{list(v.shape)}" for v in n.outs)
            kind = type(n).__name__
            detail = getattr(n, "label", "") or getattr(n, "name", "")
            lines.append(f"{outs} = {kind} {detail}")
        lines.append("return " + ", ".join(f"v{v.id}" for v in self.outputs))
        return "\n".join(lines)

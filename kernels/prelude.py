"""Kernel preludes: the WGSL through which a matmul or attention kernel reads a fused node's operands and writes its
outputs.

The matmul and attention generators take a prelude written for the node at hand: its binding declarations and one
function per operand (``load_a``, ``load_b`` and ``store_c`` for a matmul; ``load_<operand>`` for attention) whose
body evaluates the operand's fused expression (loads already turned into ``read(slot, index)``, see ``wgsl``).
The scheduler picks the expressions and the slots; this module renders them.
"""
from __future__ import annotations

from . import wgsl

# The u32 coordinates each attention operand's loader takes, in order: batch, head, query row i, key row j and
# c, the element within a row of head size.
ATTENTION_ARGS = {"q": "bhic", "k": "bhjc", "v": "bhjc", "bias": "bhij", "dout": "bhic", "lse": "bhi", "delta": "bhi"}


def attention_prelude(decl: list, bound: list, loads: list[tuple], max_bindings: int) -> str:
    """Binding declarations and one ``load_<operand>`` function per entry of ``loads``: (operand, its f32 expression,
    quads), quads being None or (slot, vec4 index of the row's first element) for a head-size operand that reads
    f32 rows starting at multiples of 4 elements. For those, ``load_<operand>4`` reads a vec4 at once through a second
    binding of the same value, typed as vec4s (appended to ``bound`` and ``decl``), while the bindings stay within
    ``max_bindings``. H200: the flash forward of 6 heads x 1500 x 1500, d 64, 195 -> 183 us; 4 x 12 heads x 1024 x
    1024 600 -> 585 us; 2 x 8 heads x 256 x 256, d 40 27.3 -> 24.9 us."""
    loaders, aliases = [], set()
    for operand, e, quads in loads:
        args = ATTENTION_ARGS[operand]
        head = ", ".join(f"{x}: u32" for x in args)
        casts = "".join(f"  let {x}_ = i32({x});\n" for x in args)
        em = wgsl.Emitter([f"{x}_" for x in args])
        value = em.value(e)
        loaders.append(f"fn load_{operand}({head}) -> f32 {{\n{casts}" + "\n".join(em.lines)
                       + f"\n  return {value};\n}}")
        if quads is not None and (quads[0] in aliases or len(bound) < max_bindings):
            slot, row = quads
            if slot not in aliases:  # one vec4 binding per value, however many operands read it
                aliases.add(slot)
                decl.append((len(bound), f"b{slot}_4", "vec4<f32>"))
                bound.append(bound[slot])
            em = wgsl.Emitter([f"{x}_" for x in args])
            start = em.value(row)
            row_args = args[:-1]
            loaders.append(f"fn load_{operand}4({''.join(f'{x}: u32, ' for x in row_args)}c4: u32) -> vec4<f32> {{\n"
                           + "".join(f"  let {x}_ = i32({x});\n" for x in row_args) + "\n".join(em.lines)
                           + f"\n  return b{slot}_4[{start} + i32(c4)];\n}}")
    return _with_helpers("\n".join([wgsl.binding_decls(decl), *loaders]))


def matmul_prelude(decl: list, axis: str, a_blocks: list[tuple], b_blocks: list[tuple], stores: list[tuple],
                   products: list = (), row_phases: list = (), quads: list = ()) -> str:
    """Bindings, ``load_a``, ``load_b`` and ``store_c`` of a matmul whose outputs lie side by side along ``axis``
    (``i`` or ``j``). ``a_blocks`` and ``b_blocks`` hold (first index along ``axis``, operand expression) per block
    (one block for the operand the outputs share); ``stores`` (first index along ``axis``, epilogue expression of
    ``acc``, output name, rows, columns, dtype) per output. ``store_c`` and a blocked loader pick the block by ``i``
    or ``j`` and index within it. ``products``: further B operands (``load_b1``, ...), whose sums ``store_c`` takes
    as ``acc1``, ...; ``row_phases``: the row prologue's terms (``row_phase0``, ...), whose sums ``load_a`` and the
    later terms read as ``row_stat0``, ... (``kernels.matmul``'s gemv declares and fills them); ``quads``: (operand,
    its other axis, vec4 binding, vec4 index of the row's first element) per operand read in vec4s
    (``matmul_quad_loader``)."""
    stats = [f"row_stat{k}" for k in range(len(row_phases))]
    parts = [wgsl.binding_decls(decl),
             block_function("load_a", ("b", "i", "p"), axis, [(s, e, None, None) for s, e in a_blocks], stats),
             block_function("load_b", ("b", "p", "j"), axis, [(s, e, None, None) for s, e in b_blocks]),
             *(block_function(f"load_b{k}", ("b", "p", "j"), axis, [(0, e, None, None)])
               for k, e in enumerate(products, 1)),
             *(block_function(f"row_phase{k}", ("b", "i", "p"), axis, [(0, e, None, None)], stats[:k])
               for k, e in enumerate(row_phases)),
             block_function("store_c", ("b", "i", "j"), axis,
                            [(s, e, f"{out}[(b_ * {wgsl.size_i32(m)} + i_) * {wgsl.size_i32(n)} + j_] = {{}};", dtype)
                             for s, e, out, m, n, dtype in stores],
                            ["acc"] + [f"acc{k}" for k in range(1, 1 + len(products))]),
             *(matmul_quad_loader(*quad) for quad in quads)]
    return _with_helpers("\n".join(parts))


def matmul_quad_loader(operand: str, other: str, binding: str, row) -> str:
    """``load_<operand>4(b, <other>, c4)`` (``kernels.matmul``'s ``vector_loads``): vec4 number c4 of the row of
    ``binding`` (the operand's value typed as vec4s) that starts at vec4 ``row``, an expression of the operand's
    coordinates (``b``, ``i``, ``p`` of A; ``b``, ``p``, ``j`` of B) without its unit-stride one."""
    args = ("b", "i", "p") if operand == "a" else ("b", "p", "j")
    em = wgsl.Emitter([f"{x}_" for x in args])
    start = em.value(row)
    return (f"fn load_{operand}4(b: u32, {other}: u32, c4: u32) -> vec4<f32> {{\n  let b_ = i32(b);\n"
            f"  let {other}_ = i32({other});\n" + "".join(f"{line}\n" for line in em.lines)
            + f"  return {binding}[{start} + i32(c4)];\n}}")


def block_function(name: str, args: tuple[str, ...], axis: str, blocks: list[tuple], accs=("acc",)) -> str:
    """A WGSL function of u32 ``args`` (each also as i32 ``<arg>_``) computing one expression per block of ``axis``.

    ``blocks`` holds (first index along ``axis``, expression, store, dtype) in order: a loader returns the
    expression (store None, an f32); ``store_c`` writes it through its store template. An expression's acc(k) is
    ``accs[k]``: parameters of ``store_c`` (``acc`` and any further products' sums), names in scope for a loader.
    With more than one block, ``<axis>_`` counts from the block's first index, and a block before the last runs only
    below the next one's first index."""
    loader = blocks[0][2] is None
    head = ", ".join(f"{x}: u32" for x in args) + ("" if loader else "".join(f", {a}: f32" for a in accs))
    lines = [f"fn {name}({head})" + (" -> f32" if loader else "") + " {"]
    blocked = axis in args and len(blocks) > 1
    lines += [f"  let {x}_ = i32({x});" for x in args if not (blocked and x == axis)]
    for k, (start, e, store, dtype) in enumerate(blocks):
        last = k == len(blocks) - 1
        indent = "  " if last else "    "
        if not last:
            lines.append(f"  if ({axis} < {blocks[k + 1][0]}u) {{")
        if blocked:
            lines.append(f"{indent}let {axis}_ = i32({axis})" + (f" - {start}i;" if start else ";"))
        em = wgsl.Emitter([f"{x}_" for x in args], list(accs), indent=indent)
        value = em.value(e)
        lines += em.lines
        if loader:
            lines.append(f"{indent}return {value};")
        else:
            lines.append(indent + store.format(wgsl.store(value, dtype)) + ("" if last else " return;"))
        if not last:
            lines.append("  }")
    return "\n".join(lines + ["}"])


def _with_helpers(body: str) -> str:
    """``body`` followed by the helper functions it calls."""
    return body + "\n" + wgsl.helpers_for(body)

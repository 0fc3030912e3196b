"""Kernel preludes: the WGSL through which a matmul or attention kernel reads a fused node's operands and writes its
outputs.

The matmul and attention generators take a prelude written for the node at hand: its binding declarations and one
function per operand (``load_a``, ``load_b`` and ``store_c`` for a matmul; ``load_<operand>`` for attention) whose
body evaluates the operand's fused expression (loads already turned into ``read(slot, index)``, see ``wgsl``).
The scheduler picks the expressions and the slots; this module renders them.
"""
from __future__ import annotations

from typing import NamedTuple

from . import wgsl

# Wide loaders read a row's elements in groups of 4 (a vec4<f32> of f32 values, a vec2<u32> of halves) or 8 (two
# vec4<f32>, one vec4<u32> of halves), each group one load (or two) through a binding of the value typed by
# ``wide_binding_type``, widened in registers; their result type by group width:
GROUP_TYPE = {4: "vec4<f32>", 8: "array<vec4<f32>, 2>"}


def wide_binding_type(kind: str, width: int) -> str:
    """The element type of a binding that reads a value stored as ``kind`` (a key of ``wgsl.STORAGE_TYPE``: "f32",
    "bf16" or "f16") in groups of ``width`` elements."""
    if kind == "f32":
        return "vec4<f32>"
    return "vec2<u32>" if width == 4 else "vec4<u32>"


def wide_unit(kind: str, width: int) -> int:
    """Elements of the value per element of its ``wide_binding_type`` binding: where rows start (a multiple of it)."""
    return 4 if kind == "f32" else width


def wide_group(binding: str, start: str, c: str, kind: str, width: int) -> str:
    """WGSL (of type ``GROUP_TYPE[width]``) of group ``c`` (u32 text) of a row that starts at element ``start`` (i32
    text) of ``binding``, a ``wide_binding_type(kind, width)`` binding."""
    if kind == "f32" and width == 8:
        at = f"{start} + 2i * i32({c})"
        return f"{GROUP_TYPE[8]}({binding}[{at}], {binding}[{at} + 1i])"
    word = f"{binding}[{start} + i32({c})]"
    return word if kind == "f32" else f"mg_widen{width}_{kind}({word})"


# The u32 coordinates each attention operand's loader takes, in order: batch, head, query row i, key row j and
# c, the element within a row of head size.
ATTENTION_ARGS = {"q": "bhic", "k": "bhjc", "v": "bhjc", "bias": "bhij", "dout": "bhic", "lse": "bhi", "delta": "bhi"}


def attention_prelude(decl: list, bound: list, loads: list[tuple], max_bindings: int, functions: str = "") -> str:
    """Binding declarations and one ``load_<operand>`` function per entry of ``loads``: (operand, its f32 expression,
    quads), quads being None or (slot, index of the row's first element in groups of 4, storage kind) for a head-size
    operand that reads
    rows starting at multiples of 4 elements. For those, ``load_<operand>4`` reads a vec4 at once through a second
    binding of the same value (``wide_binding_type``: vec4s of f32, vec2<u32>s of halves widened in registers;
    appended to ``bound`` and ``decl``), while the bindings stay within
    ``max_bindings``. H200: the flash forward of 6 heads x 1500 x 1500, d 64, 195 -> 183 us; 4 x 12 heads x 1024 x
    1024 600 -> 585 us; 2 x 8 heads x 256 x 256, d 40 27.3 -> 24.9 us. ``functions``: further WGSL functions of the
    kernel (an update's stores).

    An entry may hold a fourth item, a branch: (condition, index in ``e.args`` of the plain read that ``quads``
    describes) where ``e`` is ``where(condition, a, b)`` over a condition that does not read c and one plain read of
    a row (a cache that an update changes at a few rows: ``meganeura.lowering.attention_writes``). Its loaders then
    branch on the condition (``_branch_loaders``): ``load_<operand>_if`` holds where a row takes the other side,
    ``load_<operand>_1`` computes that side element by element, ``load_<operand>_2`` is the plain read; by groups of
    4, ``load_<operand>_14``, ``load_<operand>_24`` and ``load_<operand>4`` (``_branch_groups``)."""
    loaders, aliases = [], set()
    for operand, e, quads, *branch in loads:
        args = ATTENTION_ARGS[operand]
        side = branch[0][1] if branch and branch[0] is not None else None  # (the plain read's side of a branch)
        if side is not None:
            loaders.append(_branch_loaders(f"load_{operand}", args, e, side))
        else:
            loaders.append(_element_loader(f"load_{operand}", args, e, "f32"))
        wide = quads is not None and (quads[0] in aliases or len(bound) < max_bindings)
        if wide:
            slot, row, kind = quads
            if slot not in aliases:  # one vec4 binding per value, however many operands read it
                aliases.add(slot)
                decl.append((len(bound), f"b{slot}_4", wide_binding_type(kind, 4)))
                bound.append(bound[slot])
            name = f"load_{operand}" + ("_24" if side is not None else "4")
            loaders.append(wide_loader(name, tuple(args), args[-1], "", [(0, f"b{slot}_4", row, kind)], 4))
        if side is not None:
            loaders.append(_branch_groups(f"load_{operand}", args, wide))
    return _with_helpers("\n".join([wgsl.binding_decls(decl), *loaders, functions]))


def _element_loader(name: str, args: str, e, dtype: str) -> str:
    """``fn name(<args>: u32) -> dtype``: ``e`` over the arguments (each also as i32 ``<arg>_``)."""
    head = ", ".join(f"{x}: u32" for x in args)
    casts = "".join(f"  let {x}_ = i32({x});\n" for x in args)
    em = wgsl.Emitter([f"{x}_" for x in args])
    value = em.value(e)
    return f"fn {name}({head}) -> {dtype} {{\n{casts}" + "\n".join(em.lines) + f"\n  return {value};\n}}"


def _branch_loaders(name: str, args: str, e, read: int) -> str:
    """``name``, the loader of ``e = where(condition, a, b)`` (``attention_prelude``'s branch), whose side ``read``
    (1: a, 2: b) is the plain read: ``name_if``, true where the row takes the other side, ``name_1``, that side,
    and ``name_2``, the plain read; ``name`` branches between them, computing only the side the row takes."""
    condition, *sides = e.args
    call = f"({', '.join(args)})"
    test = _element_loader(f"{name}_if", args, condition, "bool")
    if read == 1:  # (the plain read is taken where the condition holds: name_if is its negation)
        test = test.replace("\n  return ", "\n  return !", 1)
    return "\n".join([test, _element_loader(f"{name}_1", args, sides[2 - read], "f32"),
                      _element_loader(f"{name}_2", args, sides[read - 1], "f32"),
                      f"fn {name}({', '.join(f'{x}: u32' for x in args)}) -> f32 {{\n"
                      f"  if ({name}_if{call}) {{ return {name}_1{call}; }}\n  return {name}_2{call};\n}}"])


def _branch_groups(name: str, args: str, wide: bool) -> str:
    """Group loaders of ``_branch_loaders``' ``name``: ``name_14`` and ``name_24(<args but the last>, c4)``, group
    c4 of 4 elements of each side (the plain read's ``name_24`` already defined as one wide read where ``wide``),
    and ``name4``, the group of the side the row takes (the condition does not read c). A kernel that walks a whole
    row may branch once on ``name_if`` and read the row by its side's groups (``kernels.attention``'s per-row
    forward)."""
    row, head = ", ".join(args[:-1]), ", ".join(f"{x}: u32" for x in args[:-1])
    lines = [f"fn {name}_{side}4({head}, c4: u32) -> vec4<f32> {{\n  return vec4<f32>("
             + ", ".join(f"{name}_{side}({row}, 4u * c4 + {k}u)" for k in range(4)) + ");\n}"
             for side in ((1,) if wide else (1, 2))]
    return "\n".join(lines + [f"fn {name}4({head}, c4: u32) -> vec4<f32> {{\n  if ({name}_if({row}, 0u)) "
                               f"{{ return {name}_14({row}, c4); }}\n  return {name}_24({row}, c4);\n}}"])


def matmul_prelude(decl: list, axis: str, a_blocks: list[tuple], b_blocks: list[tuple], stores: list[tuple],
                   products: list = (), row_phases: list = (), quads: list = (),
                   gemv_wide: GemvWide | None = None, pairs: bool = False) -> str:
    """Bindings, ``load_a``, ``load_b`` and ``store_c`` of a matmul whose outputs lie side by side along ``axis``
    (``i`` or ``j``). ``a_blocks`` and ``b_blocks`` hold (first index along ``axis``, operand expression) per block
    (one block for the operand the outputs share); ``stores`` (first index along ``axis``, epilogue expression of
    ``acc``, output name, rows, columns, dtype, storage kind) per output. ``store_c`` and a blocked loader pick the
    block by ``i`` or ``j`` and index within it. ``products``: further B operands (``load_b1``, ...), whose sums
    ``store_c`` takes as ``acc1``, ...; ``row_phases``: the row prologue's terms (``row_phase0``, ...), whose sums
    ``load_a`` and the later terms read as ``row_stat0``, ... (``kernels.matmul``'s gemv declares and fills them);
    ``quads``: (operand, its other axis, vec4 binding, index of the row's first element in that binding, storage
    kind) per operand read in vec4s (``matmul_quad_loader``); ``gemv_wide``: the gemv's wide loaders, which take the
    place of ``load_b`` and the further products' loaders (``gemv_wide_loaders``); ``pairs``: ``store_c2``
    (``pair_store_function``) in place of ``store_c``, for a kernel that stores pairs of neighbouring columns
    (``kernels.matmul``'s ``pairs``)."""
    stats = [f"row_stat{k}" for k in range(len(row_phases))]
    accs = ["acc"] + [f"acc{k}" for k in range(1, 1 + len(products))]
    parts = [wgsl.binding_decls(decl),
             block_function("load_a", ("b", "i", "p"), axis, [(s, e, None, None) for s, e in a_blocks], stats),
             block_function("load_b", ("b", "p", "j"), axis, [(s, e, None, None) for s, e in b_blocks]),
             *(block_function(f"load_b{k}", ("b", "p", "j"), axis, [(0, e, None, None)])
               for k, e in enumerate(products, 1)),
             *(block_function(f"row_phase{k}", ("b", "i", "p"), axis, [(0, e, None, None)], stats[:k])
               for k, e in enumerate(row_phases)),
             (pair_store_function(axis, stores, accs) if pairs else
              block_function("store_c", ("b", "i", "j"), axis,
                             [(s, e, f"{out}[(b_ * {wgsl.size_i32(m)} + i_) * {wgsl.size_i32(n)} + j_] = {{}};", dtype)
                              for s, e, out, m, n, dtype, _ in stores], accs)),
             *(matmul_quad_loader(*quad) for quad in quads)]
    if gemv_wide is not None:
        parts[2:3 + len(products)] = gemv_wide_loaders(axis, gemv_wide)
    return _with_helpers("\n".join(parts))


def pair_store_function(axis: str, stores: list[tuple], accs: list[str]) -> str:
    """``store_c2(b, i, j, acc, acc1, ...)``: the outputs at columns j and j + 1 (j even) of row i, each ``acc`` a
    vec2 of the two columns' sums: each epilogue evaluated per column (``epilogue_c<k>``), then stored; a half
    precision output's two elements as the one u32 word they share (``mg_pack_<kind>``: rounded to nearest even, as
    the pointwise kernel stores them), so that no other thread writes that word. ``stores`` as ``matmul_prelude``
    takes them, every output's columns and (along "j") every block's first column even: a pair never straddles a row
    or a block."""
    args = ("b", "i", "j")
    parts = [_epilogue_function(f"epilogue_c{k}", e, accs) for k, (_, e, *_) in enumerate(stores)]
    head = ", ".join(f"{x}: u32" for x in args) + "".join(f", {a}: vec2<f32>" for a in accs)
    lines = [f"fn store_c2({head}) {{"]
    for k, ((_, _, out, m, n, dtype, storage), indent, last) in enumerate(_per_block(lines, args, axis, stores)):
        lo, hi = (f"epilogue_c{k}(b_, i_, j_{step}, {', '.join(f'{a}[{lane}]' for a in accs)})"
                  for lane, step in enumerate(("", " + 1i")))
        at = f"(b_ * {wgsl.size_i32(m)} + i_) * {wgsl.size_i32(n)} + j_"
        lines += [f"{indent}let lo = {wgsl.store(lo, dtype)};", f"{indent}let hi = {wgsl.store(hi, dtype)};"]
        if storage in wgsl.HALF_STORAGE:
            lines.append(f"{indent}{out}[({at}) / 2i] = mg_pack_{storage}(lo, hi);")
        else:
            lines += [f"{indent}{out}[{at}] = lo;", f"{indent}{out}[{at} + 1i] = hi;"]
        if not last:
            lines.append(f"{indent}return;")
    return "\n".join(parts + lines + ["}"])


def _epilogue_function(name: str, e, accs: list[str]) -> str:
    """``name(b_, i_, j_, acc, acc1, ...) -> f32``: epilogue ``e`` at i32 coordinates (within its block)."""
    head = ", ".join(f"{x}_: i32" for x in "bij") + "".join(f", {a}: f32" for a in accs)
    em = wgsl.Emitter(["b_", "i_", "j_"], accs)
    value = em.value(e)
    return "\n".join([f"fn {name}({head}) -> f32 {{", *em.lines, f"  return {value};", "}"])


def matmul_quad_loader(operand: str, other: str, binding: str, row, kind: str = "f32") -> str:
    """``load_<operand>4(b, <other>, c4)`` (``kernels.matmul``'s ``vector_loads``): group c4 of 4 elements of the
    row of ``binding`` (the operand's value as ``wide_binding_type(kind, 4)``) that starts at its element ``row``,
    an expression of the operand's coordinates (``b``, ``i``, ``p`` of A; ``b``, ``p``, ``j`` of B) without its
    unit-stride one."""
    coords = ("b", "i", "p") if operand == "a" else ("b", "p", "j")
    fast = next(x for x in coords[1:] if x != other)
    return wide_loader(f"load_{operand}4", coords, fast, "", [(0, binding, row, kind)], 4)


class GemvWide(NamedTuple):
    """The wide loaders of a gemv over columns (m == 1, K contiguous; ``kernels.matmul_gemv``'s ``width``): each
    matrix operand (B's blocks, then each further product's B) as a list of (first column of the block, binding,
    row start in that binding's elements, storage kind), and the vector (A's row) as (binding, row start, kind), or
    None where it is not a plain read (its group is then made of ``load_a``'s elements)."""
    width: int
    matrices: list
    vector: tuple | None


def gemv_wide_loaders(axis: str, wide: GemvWide) -> list[str]:
    """``load_b8(b, j, c)``, ``load_b1_8(b, j, c)``, ... in place of the matrix operands' scalar loaders (their
    bindings are typed for groups), and ``load_a8(b, i, c)``: group c of ``wide.width`` elements along K."""
    w = wide.width
    names = [f"load_b{w}"] + [f"load_b{k}_{w}" for k in range(1, len(wide.matrices))]
    loaders = [wide_loader(name, ("b", "p", "j"), "p", axis, blocks, w) for name, blocks in zip(names, wide.matrices)]
    if wide.vector is not None:
        loaders.append(wide_loader(f"load_a{w}", ("b", "i", "p"), "p", "", [(0, *wide.vector)], w))
    else:
        elements = [f"load_a(b, i, p + {q}u)" for q in range(w)]
        quads = ", ".join(f"vec4<f32>({', '.join(elements[q:q + 4])})" for q in range(0, w, 4))
        loaders.append(f"fn load_a{w}(b: u32, i: u32, c: u32) -> {GROUP_TYPE[w]} {{\n  let p = {w}u * c;\n"
                       f"  return {GROUP_TYPE[w]}({quads});\n}}")
    return loaders


def wide_loader(name: str, coords: tuple[str, ...], fast: str, axis: str, blocks: list[tuple], width: int) -> str:
    """``name(<coords but fast>, c) -> GROUP_TYPE[width]``: group c of ``width`` elements along ``fast`` of the row at
    the other u32 coordinates, ``wide_group`` of the block's binding. ``blocks`` holds (first index along ``axis``,
    binding, row start expression over the coordinates, storage kind) in order; as in ``block_function``, with more
    than one block ``<axis>_`` counts from the block's first index, and a block before the last runs only below the
    next one's first index."""
    args = [x for x in coords if x != fast]
    lines = [f"fn {name}({''.join(f'{x}: u32, ' for x in args)}c: u32) -> {GROUP_TYPE[width]} {{"]
    for (_, binding, row, kind), indent, _ in _per_block(lines, args, axis, blocks):
        em = wgsl.Emitter([f"{x}_" for x in coords], indent=indent)
        first = em.value(row)
        lines += em.lines
        lines.append(f"{indent}return {wide_group(binding, first, 'c', kind, width)};")
    return "\n".join(lines + ["}"])


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
    for (_, e, store, dtype), indent, last in _per_block(lines, args, axis, blocks):
        em = wgsl.Emitter([f"{x}_" for x in args], list(accs), indent=indent)
        value = em.value(e)
        lines += em.lines
        if loader:
            lines.append(f"{indent}return {value};")
        else:
            lines.append(indent + store.format(wgsl.store(value, dtype)) + ("" if last else " return;"))
    return "\n".join(lines + ["}"])


def _per_block(lines: list[str], args, axis: str, blocks: list[tuple]):
    """The frame ``block_function`` and ``wide_loader`` share, appended to ``lines``: each u32 argument as i32
    ``<arg>_`` (with more than one block, ``<axis>_`` per block, from the block's first index), and each block but
    the last under ``if (<axis> < next block's first index)``. Yields (block, indent, last) while the caller appends
    the block's body."""
    blocked = axis in args and len(blocks) > 1
    lines += [f"  let {x}_ = i32({x});" for x in args if not (blocked and x == axis)]
    for k, block in enumerate(blocks):
        last = k == len(blocks) - 1
        indent = "  " if last else "    "
        if not last:
            lines.append(f"  if ({axis} < {blocks[k + 1][0]}u) {{")
        if blocked:
            lines.append(f"{indent}let {axis}_ = i32({axis})" + (f" - {block[0]}i;" if block[0] else ";"))
        yield block, indent, last
        if not last:
            lines.append("  }")


def _with_helpers(body: str) -> str:
    """``body`` followed by the helper functions it calls."""
    return body + "\n" + wgsl.helpers_for(body)

"""Tests for meganeura.kernels.wgsl's expression emission: index math known to be non-negative divides unsigned,
and a two-sided range check is one unsigned comparison (their results are checked by every kernel test)."""
from meganeura.kernels.wgsl import Emitter
from meganeura.lowering import expr as E


def _i(v):
    return E.const(v, E.I32)


def _emit(e) -> str:
    em = Emitter(["x_", "y_"])
    value = em.value(e)
    return "\n".join(em.lines + [value])


def test_division_of_a_non_negative_index_by_a_constant_is_unsigned():
    row = E.binary("idiv", E.add(E.mul(E.coord(0), _i(3)), E.binary("imod", E.coord(1), _i(7))), _i(14))
    text = _emit(E.binary("imod", row, _i(5)))
    assert "i32(u32(y_) % 7u)" in text and "/ 14u)" in text and "% 5u)" in text


def test_division_that_may_see_a_negative_value_stays_signed():
    shifted = E.add(E.coord(0), _i(-1))  # -1 at the first coordinate
    assert "u32(" not in _emit(E.binary("idiv", shifted, _i(2)))
    assert "u32(" not in _emit(E.binary("idiv", E.coord(0), E.coord(1)))  # not a constant divisor


def test_two_sided_range_check_is_one_unsigned_comparison():
    pos = E.add(E.coord(0), _i(-1))
    inside = E.binary("and", E.binary("lt", pos, _i(14)), E.binary("ge", pos, _i(0)))
    assert _emit(inside).endswith("(u32(t0) < 14u);\nt1")
    one_sided = E.binary("and", E.binary("ge", pos, _i(1)), E.binary("lt", pos, _i(14)))
    assert "u32(" not in _emit(one_sided)

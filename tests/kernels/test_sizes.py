"""Sizes as values (``meganeura.kernels.sizes``): arithmetic, decisions recorded as guards, evaluation and WGSL."""
import pytest

from meganeura.kernels import sizes as S


def test_arithmetic_stays_symbolic_and_folds_to_ints():
    guards = S.Guards({0: 2, 1: 2})
    with guards.recording():
        a, b = S.symbol(0, 5), S.symbol(1, 3)
        n = a * 64 + b * 2
        assert n.hint == 326 and n - a * 64 - b * 2 == 0
        assert isinstance(n * 3 - n * 3, int)
        assert (n * 2) // 2 - n == 0  # exact division by a constant
        assert (a * b * 8) // (a * b) == 8  # and by a monomial
        assert (n * 4) % 2 == 0
        assert S.ceil_div(n, 4).hint == 82
    assert guards.items == []  # nothing was decided


def test_decisions_are_guards_unless_the_bounds_settle_them():
    guards = S.Guards({0: 2, 1: 2})
    with guards.recording():
        a, b = S.symbol(0, 5), S.symbol(1, 3)
        assert a * 4 + 1 > 0 and a != 1 and a >= 2  # settled by the lower bounds: no guard
        assert guards.items == []
        assert not a < b
        assert int(b) == 3 and f"{a}u" == "5u"  # concrete values pin the symbols
    assert guards.check((5, 3)) and not guards.check((6, 3)) and not guards.check((5, 4))
    assert not guards.check((1, 3))  # below a lower bound


def test_a_decision_outside_a_compile_is_an_error():
    with pytest.raises(S.SizeError, match="outside a compile"):
        bool(S.symbol(0, 4) > 3)


def test_evaluation_wgsl_and_json():
    a, b = S.symbol(0, 5), S.symbol(1, 3)
    n = S.ceil_div(a * 64 + b, 4)
    assert S.evaluator([n, 7, a * b])((6, 4)) == ((6 * 64 + 4 + 3) // 4, 7, 24)
    assert S.from_json(n.to_json(), [5, 3]) - n == 0
    assert (a * 64 + b * 2).wgsl(lambda k: f"sz[{k}]") == "(sz[0] * 64i + sz[1] * 2i)"
    with pytest.raises(S.SizeError, match="symbol 2"):
        S.from_json(S.symbol(2, 1).to_json(), [5, 3])

"""The WGSL helper functions of the op table (``wgsl.FLOAT_OPS``...), emitted into a kernel only where its code calls
them (``wgsl.helpers_for``), with those they call (``HELPER_DEPS``).

The float functions match eager float32's accuracy where the WGSL built-ins do not (docs/ops.md: range reduction
with split constants, polynomials, and exact splits by bit masks: lavapipe's compiler neither fuses fma nor keeps a
compensated sum by cancellation); the half precision ones widen and narrow bfloat16 and float16 stored two to a u32
word, with integer operations only (no ``shader-f16``).
"""
from __future__ import annotations

# erfc's fits (mg_erfc_abs): z erfcx(z) - 1/2 for z >= 1 as a polynomial in 1/z - 0.55, and erfcx(z) - 1/2 for
# 0.47 <= z < 1 in z - 0.735 (erfcx(z) = erfc(z) exp(z^2)), least squares in relative error with each coefficient
# rounded to f32 in turn: within 2.0e-9 and 2.5e-10 of them.
ERFCX_FAR = (0.002353423275053501, -0.17003512382507324, -0.020363885909318924, 0.09835844486951828,
             -0.09701512008905411, 0.049838170409202576, 0.011788437142968178, -0.06028817594051361,
             0.0851764902472496, -0.09662264585494995, 0.042506955564022064, 0.12043057382106781,
             -0.15005552768707275)
ERFCX_NEAR = (0.012509647756814957, -0.37498998641967773, 0.23689202964305878, -0.13391618430614471,
              0.06923064589500427, -0.03320932388305664, 0.01496181171387434, -0.006470789201557636,
              0.0024613626301288605)


def _horner(x: str, coefficients) -> str:
    """WGSL for the polynomial sum(c_i x^i), in Horner's form."""
    text = repr(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        text = f"{c!r} + {x} * ({text})"
    return text


# Helper functions referenced by the op table; only those used are emitted.
HELPERS = {
    # erfc(z) for z >= 0 (the Chebyshev fit this replaces, 1.2e-7 relative, was 4-5x eager's error): 1 - erf(z) below
    # 0.47, where erf < 1/2 rounds finer than erfc; above, erfcx(z) exp(-z^2) with erfcx fitted (ERFCX_NEAR below 1,
    # ERFCX_FAR as z erfcx(z) over 1/z = vh + vl, the division's residual taken exactly) and exp(-z^2) =
    # 2^k (1 + w) exp(-d): z = zh + zl in 12-bit parts, zh^2 exact and reduced by k ln2 in two parts (as mg_exp), d =
    # zl (2 zh + zl) small. erfcx = a + b with a = 1/2 or vh / 2 exact, so that erfcx (1 + w) (1 + expm1(-d)) rounds
    # once, at its end. erfc is 0 in f32 from 10.06 on (z is clamped at 11: inf - inf would be NaN below).
    "mg_erfc_abs": f"""fn mg_erfc_abs(x: f32) -> f32 {{
  let z = min(x, 11.0);
  let zh = mg_hi12(z);
  let zl = z - zh;
  let q = zh * zh;
  let k = round(q * -1.4426950408889634);
  let r = (-q - k * 0.693145751953125) - k * 1.4286068203094173e-06;
  let w = r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0
      + r * (1.0 / 5040.0 + r * (1.0 / 40320.0))))))));
  let d = zl * (zh + zh + zl);
  let m = -d * (1.0 - d * (0.5 - d * (1.0 / 6.0 - d * (1.0 / 24.0 - d * (1.0 / 120.0 - d * (1.0 / 720.0))))));
  let vh = 1.0 / z;
  let v1 = mg_hi12(vh);
  let v2 = vh - v1;
  let vl = (((1.0 - zh * v1) - (zh * v2 + zl * v1)) - zl * v2) * vh;
  let u = vh - 0.55;
  let t = z - 0.735;
  let far = {_horner("u", ERFCX_FAR)};
  let near = {_horner("t", ERFCX_NEAR)};
  let a = select(0.5, 0.5 * vh, z >= 1.0);
  let b = select(near, vh * far + vl * (0.5 + far), z >= 1.0);
  let p = a + (b + (a + b) * ((w + m) + w * m));
  return select(mg_ldexp_halves(p, k), 1.0 - mg_erf_series(z), z < 0.47);
}}""",
    # erf below 1 by its Maclaurin series to x^21 (the first term left out is below 1.5e-9 relative) as a + a k(a^2),
    # fdlibm's form: a itself exact, k = erf(a) / a - 1 at most 16 % of the sum (c a + a (...), 2/sqrt(pi) = c in two
    # parts, was factored by lavapipe's compiler into a (c + ...), rounding c: 2.4x eager's error; now 1.0-1.15x).
    # 1 - erfc above, where erfc < 0.16.
    "mg_erf_series": """fn mg_erf_series(a: f32) -> f32 {
  let z = a * a;
  let k = 0.12837916709551256 + z * (-0.37612638903183754 + z * (0.11283791670955126 + z * (-0.026866170645131252
      + z * (0.005223977625442188 + z * (-0.0008548327023450852 + z * (0.00012055332981789664
      + z * (-1.492565035840625e-05 + z * (1.6462114365889246e-06 + z * (-1.6365844691234924e-07
      + z * 1.4807192815879218e-08)))))))));
  return a + a * k;
}""",
    "mg_erf": """fn mg_erf(x: f32) -> f32 {
  let a = abs(x);
  let r = select(mg_erf_series(a), 1.0 - mg_erfc_abs(a), a >= 1.0);
  return select(bitcast<f32>(bitcast<u32>(r) | (bitcast<u32>(x) & 0x80000000u)), x, mg_isnan(x));
}""",
    "mg_erfc": """fn mg_erfc(x: f32) -> f32 {
  let r = mg_erfc_abs(abs(x));
  return select(select(r, 2.0 - r, x < 0.0), x, mg_isnan(x));
}""",
    "mg_isnan": "fn mg_isnan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }",
    "mg_isinf": "fn mg_isinf(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u; }",
    "mg_max": """fn mg_max(a: f32, b: f32) -> f32 {
  return select(max(a, b), a + b, mg_isnan(a) || mg_isnan(b));
}""",
    "mg_min": """fn mg_min(a: f32, b: f32) -> f32 {
  return select(min(a, b), a + b, mg_isnan(a) || mg_isnan(b));
}""",
    # pow as C99's powf (torch's special cases: zeros, infinities, NaN, negative bases with integer exponents) around
    # |x|^y for finite |x| > 0 and y (mg_pow_positive).
    "mg_pow": """fn mg_pow(x: f32, y: f32) -> f32 {
  let a = abs(x);
  let integer = trunc(y) == y;
  let odd = integer && trunc(0.5 * y) != 0.5 * y;
  let edge = a == 0.0 || mg_isinf(a) || mg_isinf(y);  // 0 or inf, by whether |x| and y lie on one side of 1 and 0
  var r = select(mg_pow_positive(a, y), select(0.0, bitcast<f32>(0x7f800000u), (y > 0.0) == (a > 1.0)), edge);
  r = select(r, -r, odd && (bitcast<u32>(x) & 0x80000000u) != 0u);
  r = select(r, bitcast<f32>(0x7fc00000u), x < 0.0 && !mg_isinf(x) && !integer);
  r = select(r, x + y, mg_isnan(x) || mg_isnan(y));
  return select(r, 1.0, y == 0.0 || x == 1.0 || (a == 1.0 && mg_isinf(y)));
}""",
    # |x|^y = 2^(y log2 |x|) with the exponent's rounding left out (the built-in, exp2(y log2(x)) in f32, was 14-270x
    # eager's relative error on lavapipe, 94 ULP at most): log2 |x| = e + h + l (mg_log2_parts), y = yh + yl in 12-bit
    # halves, so that yh e, yh h, yl e and yl h are exact and only y l (at most 1 % of the whole) rounds; the integer
    # parts leave the sum before it rounds. Now 1.0-1.35x eager's error, 1.5 ULP at most where |y log2 x| < 30; up to
    # 4 ULP where it nears 128 with x's mantissa near sqrt(2)^+-1 (log2 parts' 2^-28.5 times y). Exponents beyond
    # +-512 give 0 or inf directly (their exact parts could overflow to inf - inf).
    "mg_pow_positive": """fn mg_pow_positive(a: f32, y: f32) -> f32 {
  let g = mg_log2_parts(a);
  let yh = mg_hi12(y);
  let yl = y - yh;
  let t1 = yh * g.x;
  let t2 = yh * g.y;
  let n1 = round(t1);
  let n2 = round(t2);
  let u = ((t1 - n1) + (t2 - n2)) + ((yl * g.x + y * g.z) + yl * g.y);  // (no two products of one factor summed:
  let n3 = round(u);                                                    //  a compiler may factor them, rounding once)
  let k = clamp(n1 + n2 + n3, -160.0, 140.0);  // beyond: 0 or inf, within ldexp's defined range in two halves
  let r = mg_ldexp_halves(mg_exp_poly((u - n3) * 0.6931471805599453), k);
  let rough = y * (g.x + g.y);
  return select(r, select(0.0, bitcast<f32>(0x7f800000u), rough > 0.0), abs(rough) > 512.0);
}""",
    # log2 x = e + h + l for finite x > 0: e an integer, h of 12 significant bits, l the rest (at most 1 % of h); h + l
    # within 2^-28.5 of log2 m (2^-31.5 rms). With m = 1 + f (mg_log_reduce), log m = 2 atanh(s), s = f / (2 + f) =
    # sh + sl: sh rounded, sl from the residual f - sh (2 + f), taken exactly (f - 2 sh and each 12-bit partial product
    # of sh f subtracted in turn cancel exactly, by Sterbenz's lemma); the series' tail (to s^13, at most 1 % of 2s: its
    # f32 rounding is the 2^-28.5) and sl's share in it in f32; 2 sh / ln 2 with 1 / ln 2 = C1 + C2, C1 of 12 bits.
    "mg_log2_parts": """fn mg_log2_parts(x: f32) -> vec3<f32> {
  let me = mg_log_reduce(x);
  let f = me.x - 1.0;
  let d = 2.0 + f;
  let sh = f / d;
  let s1 = mg_hi12(sh);
  let s2 = sh - s1;
  let f1 = mg_hi12(f);
  let f2 = f - f1;
  let sl = ((((f - 2.0 * sh) - s1 * f1) - (s1 * f2 + s2 * f1)) - s2 * f2) / d;
  let z = sh * sh;
  let q = 0.3333333333333333 + z * (0.2 + z * (0.14285714285714285 + z * (0.1111111111111111
      + z * (0.09090909090909091 + z * 0.07692307692307693))));
  let tail = 2.0 * sl * (1.0 + z) + 2.0 * sh * z * q;
  let a = 2.0 * sh;
  let a1 = mg_hi12(a);
  let p = a1 * 1.4423828125;  // C1 (exact product: 12 bits by 12)
  let h = mg_hi12(p);
  let l = ((p - h) + (a - a1) * 1.4423828125) + (a * 3.1222839e-04 + tail * 1.4426950408889634);
  return vec3<f32>(me.y, h, l);
}""",
    # (a.x + a.y) + (b.x + b.y) as a pair (hi, lo) for accurate sums: hi = a.x + b.x after both are cut to a multiple of
    # twice the spacing of the larger (mg_grid), which makes it exact (a float sum's rounding is not recovered by
    # cancellation, (s - a) - b, which compilers may fold to 0); the bits cut off (under 2 ULP of the larger) and the
    # los add into lo, which stays far below hi. mg_sum2_total rounds the pair once (hi alone where it is infinite: lo
    # is NaN then).
    "mg_sum2": """fn mg_sum2(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
  let e = max((bitcast<u32>(a.x) >> 23u) & 0xffu, (bitcast<u32>(b.x) >> 23u) & 0xffu);
  let ah = mg_grid(a.x, e);
  let bh = mg_grid(b.x, e);
  return vec2<f32>(ah + bh, (a.y + b.y) + ((a.x - ah) + (b.x - bh)));
}""",
    # x cut toward 0 to a multiple of 2^(e - 149), e a biased exponent at least x's
    "mg_grid": """fn mg_grid(x: f32, e: u32) -> f32 {
  let bits = bitcast<u32>(x);
  let cut = e + 1u - max((bits >> 23u) & 0xffu, 1u);  // low bits of x's significand to clear
  return select(bitcast<f32>(bits & (0xffffffffu << min(cut, 31u))), 0.0, cut > 23u);
}""",
    "mg_sum2_total": "fn mg_sum2_total(a: vec2<f32>) -> f32 { return select(a.x + a.y, a.x, mg_isinf(a.x)); }",
    # x's upper 12 significant bits (the product of two such numbers is exact in f32: Dekker's split by a mask, as
    # fma is not fused on every driver and a compiler may simplify Veltkamp's (c x) - (c x - x) to x)
    "mg_hi12": "fn mg_hi12(x: f32) -> f32 { return bitcast<f32>(bitcast<u32>(x) & 0xfffff000u); }",
    "mg_remainder": """fn mg_remainder(a: f32, b: f32) -> f32 {
  let r = a % b;
  return select(r, r + b, r != 0.0 && ((r < 0.0) != (b < 0.0)));
}""",
    "mg_floordiv": """fn mg_floordiv(a: f32, b: f32) -> f32 {
  let m = a % b;
  var d = (a - m) / b;
  if (m != 0.0 && ((b < 0.0) != (m < 0.0))) { d = d - 1.0; }
  var f = floor(d);
  if (d - f > 0.5) { f = f + 1.0; }
  return select(f, a / b, b == 0.0);
}""",
    # Signed remainders are spelled a - b * (a / b): the i32 `%` of negative operands came out as an
    # unsigned remainder on an NVIDIA Vulkan driver (H200, wgpu 0.32), while `/` was right.
    "mg_ifmod": "fn mg_ifmod(a: i32, b: i32) -> i32 { return a - b * (a / b); }",
    "mg_ifloordiv": """fn mg_ifloordiv(a: i32, b: i32) -> i32 {
  let q = a / b;
  return select(q, q - 1, (a - b * q != 0) && ((a < 0) != (b < 0)));
}""",
    "mg_iremainder": """fn mg_iremainder(a: i32, b: i32) -> i32 {
  let r = a - b * (a / b);
  return select(r, r + b, r != 0 && ((r < 0) != (b < 0)));
}""",
    # exp to about 1 ULP (the built-in may be off by 3 + 2|x| ULP): x = k ln2 + r with ln2 split in two (the high
    # part's 16 significant bits make k * hi exact for every k that does not overflow), exp(r) for |r| <= ln2 / 2
    # by its Taylor polynomial to r^7 (truncation below 6e-9 relative), 2^k applied in two halves (ldexp's exponent
    # must stay within f32's range: k reaches -150 for subnormal results).
    "mg_exp_poly": """fn mg_exp_poly(r: f32) -> f32 {
  return 1.0 + r * (1.0 + r * (0.5 + r * (0.16666666666666666 + r * (0.041666666666666664
      + r * (0.008333333333333333 + r * (0.001388888888888889 + r * 0.0001984126984126984))))));
}""",
    "mg_ldexp_halves": """fn mg_ldexp_halves(p: f32, k: f32) -> f32 {
  let ki = i32(k);
  let half = ki / 2i;
  return ldexp(ldexp(p, half), ki - half);
}""",
    "mg_exp": """fn mg_exp(x: f32) -> f32 {
  let xc = clamp(x, -104.0, 89.0);
  let k = round(xc * 1.4426950408889634);
  let r = (xc - k * 0.693145751953125) - k * 1.4286068203094173e-06;
  return select(mg_ldexp_halves(mg_exp_poly(r), k), x, mg_isnan(x));
}""",
    # exp2 to about 1 ULP (the built-in was 3.5x eager's error): x = k + f with k = round(x), f exact, 2^f =
    # exp(f ln2) by mg_exp's polynomial (|f ln2| <= 0.35: its rounding costs a third of an ULP).
    "mg_exp2": """fn mg_exp2(x: f32) -> f32 {
  let xc = clamp(x, -150.0, 128.0);
  let k = round(xc);
  return select(mg_ldexp_halves(mg_exp_poly((xc - k) * 0.6931471805599453), k), x, mg_isnan(x));
}""",
    # log to about 1 ULP (the built-in's error is absolute, 2^-21, on [0.5, 2]: relative 1e-3 near 1): x = m 2^e
    # with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s) for s = (m - 1) / (m + 1), |s| < 0.172, by its series to
    # s^11 (truncation below 3e-10); subnormal x scaled up by 2^23 first. mg_log_reduce returns (m, e), mg_log_parts
    # (e, log m); log adds e ln2 with ln2 split as in mg_exp, log2 adds e exactly. 0, negatives, inf and NaN as IEEE
    # (mg_log_special).
    "mg_log_reduce": """fn mg_log_reduce(x: f32) -> vec2<f32> {
  let tiny = x < 1.1754943508222875e-38;
  let parts = frexp(select(x, x * 8388608.0, tiny));
  let low = parts.fract < 0.70710678118654752;
  let m = select(parts.fract, parts.fract * 2.0, low);
  return vec2<f32>(m, f32(select(parts.exp, parts.exp - 1i, low) - select(0i, 23i, tiny)));
}""",
    "mg_log_parts": """fn mg_log_parts(x: f32) -> vec2<f32> {
  let me = mg_log_reduce(x);
  let m = me.x;
  let e = me.y;
  let s = (m - 1.0) / (m + 1.0);
  let z = s * s;
  let series = z * (0.3333333333333333 + z * (0.2 + z * (0.14285714285714285 + z * (0.1111111111111111
      + z * 0.09090909090909091))));
  return vec2<f32>(e, 2.0 * s + 2.0 * s * series);
}""",
    "mg_log_special": """fn mg_log_special(x: f32, y: f32) -> f32 {
  let special = select(select(x, bitcast<f32>(0xff800000u), x == 0.0), bitcast<f32>(0x7fc00000u),
      x < 0.0 || mg_isnan(x));
  return select(y, special, x <= 0.0 || mg_isnan(x) || mg_isinf(x));
}""",
    "mg_log": """fn mg_log(x: f32) -> f32 {
  let p = mg_log_parts(x);
  return mg_log_special(x, p.x * 0.693145751953125 + (p.x * 1.4286068203094173e-06 + p.y));
}""",
    # log10 as log: e log10(2) with log10(2) split in two (its high part's 11 significant bits make e * hi exact),
    # plus log(m) / ln 10 (log(x) * (1 / ln 10) rounded twice: up to 2.8 ULP, 0.42 on average)
    "mg_log10": """fn mg_log10(x: f32) -> f32 {
  let p = mg_log_parts(x);
  return mg_log_special(x, p.x * 0.301025390625 + (p.x * 4.6050389811980175e-06 + p.y * 0.43429448190325176));
}""",
    "mg_log2": """fn mg_log2(x: f32) -> f32 {
  let p = mg_log_parts(x);
  return mg_log_special(x, p.x + p.y * 1.4426950408889634);
}""",
    # log1p(x) = 2 atanh(s), s = x / (2 + x), as its odd series on [-0.5, 1] (|s| <= 1/3: 9 terms reach 2^-24);
    # log(1 + x) outside, where 1 + x loses no digit that matters. Goldberg's log(u) x / (u - 1) needs (1 + x) - 1
    # kept as written, which shader compilers may fold to x (lavapipe does: log1p(3e-7) came out 3.58e-7).
    "mg_log1p": """fn mg_log1p(x: f32) -> f32 {
  let s = x / (2.0 + x);
  let s2 = s * s;
  let odd = 1.0 / 3.0 + s2 * (1.0 / 5.0 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0 + s2 * (1.0 / 11.0 + s2 * (1.0 / 13.0
      + s2 * (1.0 / 15.0 + s2 * (1.0 / 17.0)))))));
  return select(mg_log(1.0 + x), 2.0 * s + 2.0 * s * s2 * odd, x >= -0.5 && x <= 1.0);
}""",
    # expm1 to about 1 ULP (exp(x) - 1 was 2.3x eager's error: it cancels below |x| ~ 1): its Taylor series to x^12
    # for |x| < 1.25 (the first term left out is below 2e-9 relative), exp(x) - 1 above, where it loses under a bit;
    # zeros keep their sign.
    "mg_expm1": """fn mg_expm1(x: f32) -> f32 {
  let series = x + x * x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0 + x * (1.0 / 720.0
      + x * (1.0 / 5040.0 + x * (1.0 / 40320.0 + x * (1.0 / 362880.0 + x * (1.0 / 3628800.0
      + x * (1.0 / 39916800.0 + x * (1.0 / 479001600.0)))))))))));
  return select(select(mg_exp(x) - 1.0, series, abs(x) < 1.25), x, x == 0.0);
}""",
    # sinh and cosh to about 1 ULP (the built-ins were 4.5x eager's error): sinh's odd Taylor series to |x|^13 below 1
    # (the first term left out is below 2e-10 relative), else (E -+ 1 / E) / 2 with E = exp(|x|) up to 88, where E
    # still fits f32, and (exp(|x| / 2) / 2) exp(|x| / 2) up to their own overflow, 89.4. The sign from x's bits.
    "mg_sinh": """fn mg_sinh(x: f32) -> f32 {
  let a = abs(x);
  let z = a * a;
  let series = a + a * z * (1.0 / 6.0 + z * (1.0 / 120.0 + z * (1.0 / 5040.0 + z * (1.0 / 362880.0
      + z * (1.0 / 39916800.0 + z * (1.0 / 6227020800.0))))));
  let e = mg_exp(min(a, 88.0));
  let h = mg_exp(0.5 * a);
  let r = select(select(0.5 * (e - 1.0 / e), (0.5 * h) * h, a > 88.0), series, a < 1.0);
  return select(bitcast<f32>(bitcast<u32>(r) | (bitcast<u32>(x) & 0x80000000u)), x, mg_isnan(x));
}""",
    "mg_cosh": """fn mg_cosh(x: f32) -> f32 {
  let a = abs(x);
  let e = mg_exp(min(a, 88.0));
  let h = mg_exp(0.5 * a);
  return select(select(0.5 * (e + 1.0 / e), (0.5 * h) * h, a > 88.0), x, mg_isnan(x));
}""",

    # asin and acos through atan2: lavapipe's builtins are off by up to 4e-4 (WGSL allows atan2's error only).
    # atan to about 1 ULP (the built-in was 35x eager's error on lavapipe): |x| reduced to |t| <= tan(pi/8) by
    # atan(x) = pi/4 + atan((x-1)/(x+1)) or pi/2 - atan(1/x), pi/4 and pi/2 split in two, and atan(t) by its Taylor
    # series to t^17 (the first term left out is below 3e-9 absolute).
    "mg_atan": """fn mg_atan(x: f32) -> f32 {
  let a = abs(x);
  let big = a > 2.4142135623730951;
  let mid = a > 0.41421356237309503;
  let t = select(select(a, (a - 1.0) / (a + 1.0), mid), -1.0 / a, big);
  let hi = select(select(0.0, 0.78539818525314331, mid), 1.5707963705062866, big);
  let lo = select(select(0.0, -2.1855694e-08, mid), -4.3711388e-08, big);
  let z = t * t;
  let p = z * (-0.33333333333333333 + z * (0.2 + z * (-0.14285714285714285 + z * (0.11111111111111111
      + z * (-0.090909090909090909 + z * (0.076923076923076923 + z * (-0.066666666666666667
      + z * 0.058823529411764706)))))));
  let r = hi + (lo + (t + t * p));
  return select(bitcast<f32>(bitcast<u32>(r) | (bitcast<u32>(x) & 0x80000000u)), x, mg_isnan(x));
}""",
    # atan2 through mg_atan (the built-in was 8.7x eager's error): the first quadrant's angle from the smaller of
    # |y| / |x| and |x| / |y| (an argument at most 1), then pi/2 - it, pi - it and the sign of y by quadrant, with
    # IEEE's special cases: zeros by their signs, infinities (pi/4 for two), NaN through.
    "mg_atan2": """fn mg_atan2(y: f32, x: f32) -> f32 {
  let ay = abs(y);
  let ax = abs(x);
  let steep = ay > ax;
  var r = mg_atan(select(ay / ax, ax / ay, steep));
  r = select(r, (1.5707963705062866 - r) - 4.3711388e-08, steep);
  r = select(r, 0.0, ay == 0.0);
  r = select(r, 0.78539818525314331, ay == ax && ax > 3.4028235e38);
  r = select(r, (3.1415927410125732 - r) - 8.7422777e-08, (bitcast<u32>(x) & 0x80000000u) != 0u);
  r = bitcast<f32>(bitcast<u32>(r) | (bitcast<u32>(y) & 0x80000000u));
  return select(r, x + y, mg_isnan(x) || mg_isnan(y));
}""",
    # asin and acos to about 1 ULP (the built-ins were 61x eager's error): Cephes' reduction, asin(s) = s + s z P(z)
    # with z = s^2 for |s| <= 1/2, and asin(a) = pi/2 - 2 asin(s) with s = sqrt((1 - a) / 2) above (1 - a exact
    # there; the square root's rounding error is added back from its exact residual by fma, as fdlibm adds it in
    # double); acos as 2 asin(s) near 1 (keeping its relative accuracy), pi - 2 asin(s) near -1, pi/2 - asin(x)
    # between. pi/2 and pi in two parts. |x| > 1 gives NaN, as torch.
    "mg_asin_poly": """fn mg_asin_poly(z: f32) -> f32 {
  return z * (0.16666752422 + z * (0.074953002686 + z * (0.045470025998 + z * (0.024181311049
      + z * 0.042163199048))));
}""",
    "mg_asin_far": """fn mg_asin_far(z: f32, top_hi: f32, top_lo: f32) -> f32 {
  // top - 2 asin(sqrt(z)) for z = (1 - |x|) / 2 <= 1/4, top = top_hi + top_lo (pi/2 or pi)
  let s = sqrt(z);
  let correction = select(0.0, fma(-s, s, z) / (2.0 * s), s > 0.0);
  return (top_hi - 2.0 * s) - (2.0 * (correction + s * mg_asin_poly(z)) - top_lo);
}""",
    "mg_asin": """fn mg_asin(x: f32) -> f32 {
  let a = abs(x);
  let r = select(a + a * mg_asin_poly(a * a), mg_asin_far(0.5 * (1.0 - a), 1.5707963705062866, -4.3711388e-08),
                 a > 0.5);
  return select(bitcast<f32>(bitcast<u32>(r) | (bitcast<u32>(x) & 0x80000000u)), x, mg_isnan(x));
}""",
    "mg_acos": """fn mg_acos(x: f32) -> f32 {
  let z = 0.5 * (1.0 - abs(x));
  let s = sqrt(z);
  let middle = (1.5707963705062866 - (x + x * mg_asin_poly(x * x))) - 4.3711388e-08;
  let near_minus_one = mg_asin_far(z, 3.1415927410125732, -8.7422777e-08);
  return select(select(middle, near_minus_one, x < -0.5), 2.0 * (s + s * mg_asin_poly(z)), x > 0.5);
}""",
    "mg_sign": "fn mg_sign(x: f32) -> f32 { return select(sign(x), x, x != x); }",
    # tanh to about 1 ULP (the built-in was 3x eager's error): Cephes' odd polynomial below 0.625, where
    # 1 - 2 / (e^2|x| + 1) would cancel, and that form with the accurate mg_exp above; the sign from x's bits.
    "mg_tanh": """fn mg_tanh(x: f32) -> f32 {
  let a = abs(x);
  let z = a * a;
  let small = a + a * z * (-0.333332819422 + z * (0.133314422036 + z * (-0.0537397155531 + z * (0.0206390887954
      + z * -0.00570498872745))));
  let large = 1.0 - 2.0 / (mg_exp(2.0 * min(a, 20.0)) + 1.0);
  let r = select(small, large, a >= 0.625);
  return select(bitcast<f32>(bitcast<u32>(r) | (bitcast<u32>(x) & 0x80000000u)), x, mg_isnan(x));
}""",
    "mg_sigmoid": "fn mg_sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + mg_exp(-x)); }",
    # An integer hash with full avalanche (Wellons' lowbias32 constants), the core of the counter-based RNG.
    "mg_hash": """fn mg_hash(v: u32) -> u32 {
  var x = v;
  x = (x ^ (x >> 16u)) * 0x7feb352du;
  x = (x ^ (x >> 15u)) * 0x846ca68bu;
  return x ^ (x >> 16u);
}""",
    "mg_uniform": """fn mg_uniform(k0: i32, k1: i32, stream: i32, n: i32) -> f32 {
  let key = mg_hash(bitcast<u32>(k0) ^ mg_hash(bitcast<u32>(k1) + 0x9e3779b9u * bitcast<u32>(stream)));
  let h = mg_hash(mg_hash(bitcast<u32>(n) ^ key) + key);
  return f32(h >> 8u) * (1.0 / 16777216.0);
}""",
}
# Half precision storage without the shader-f16 feature: element 2k of a tensor in the low 16 bits of word k.
# Widening is exact; narrowing rounds to nearest even, keeps NaN (quiet) and infinities, and overflows to infinity
# as torch's conversions do. float16 goes by integer bit operations both ways, as bfloat16 does, depending on no
# built-in: pack2x16float leaves out-of-range values undefined; and with unpack2x16float, the one float16-only step on
# its path, a float16 ResNet-50 came out wrong on the H200 (0.44 relative L2) while bfloat16 and lavapipe were right
# at the same shapes; widened by bit operations it passes there (2.1e-4). A subnormal half widens through an exact
# product by 2^-24. The float16 conversions choose among their cases by select, not by branches: they run for every
# element a matmul or attention kernel loads (on the H200, float16 calls took up to 1.6x bfloat16's with branches).
# The wide forms widen 4 halves (a vec2<u32>) or 8 (a vec4<u32>) at once, for loaders that read a row's halves in
# groups (``kernels.prelude.wide_group``): one load per 4 or 8 elements, not one 32-bit load (and select) per element.
HALF_HELPERS = {
    "mg_widen_bf16": """fn mg_widen_bf16(w: u32, hi: u32) -> f32 {
  return bitcast<f32>(select(w << 16u, w & 0xffff0000u, hi == 1u));
}""",
    "mg_widen_f16": """fn mg_widen_f16(w: u32, hi: u32) -> f32 {
  let h = select(w & 0xffffu, w >> 16u, hi == 1u);
  let em = h & 0x7fffu;
  let normal = (em << 13u) + 0x38000000u;
  let special = (em << 13u) | 0x7f800000u;
  let small = bitcast<u32>(f32(em) * 5.9604644775390625e-8);
  let mag = select(select(normal, special, em >= 0x7c00u), small, em < 0x400u);
  return bitcast<f32>(((h & 0x8000u) << 16u) | mag);
}""",
    "mg_widen4_bf16": """fn mg_widen4_bf16(w: vec2<u32>) -> vec4<f32> {
  return bitcast<vec4<f32>>(vec4<u32>(w.x << 16u, w.x & 0xffff0000u, w.y << 16u, w.y & 0xffff0000u));
}""",
    "mg_widen4_f16": """fn mg_widen4_f16(w: vec2<u32>) -> vec4<f32> {
  let h = vec4<u32>(w.x & 0xffffu, w.x >> 16u, w.y & 0xffffu, w.y >> 16u);
  let em = h & vec4<u32>(0x7fffu);
  let normal = (em << vec4<u32>(13u)) + vec4<u32>(0x38000000u);
  let special = (em << vec4<u32>(13u)) | vec4<u32>(0x7f800000u);
  let small = bitcast<vec4<u32>>(vec4<f32>(em) * 5.9604644775390625e-8);
  let mag = select(select(normal, special, em >= vec4<u32>(0x7c00u)), small, em < vec4<u32>(0x400u));
  return bitcast<vec4<f32>>(((h & vec4<u32>(0x8000u)) << vec4<u32>(16u)) | mag);
}""",
    "mg_widen8_bf16": """fn mg_widen8_bf16(w: vec4<u32>) -> array<vec4<f32>, 2> {
  return array<vec4<f32>, 2>(mg_widen4_bf16(w.xy), mg_widen4_bf16(w.zw));
}""",
    "mg_widen8_f16": """fn mg_widen8_f16(w: vec4<u32>) -> array<vec4<f32>, 2> {
  return array<vec4<f32>, 2>(mg_widen4_f16(w.xy), mg_widen4_f16(w.zw));
}""",
    "mg_bf16_bits": """fn mg_bf16_bits(x: f32) -> u32 {
  let u = bitcast<u32>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) { return (u >> 16u) | 0x40u; }
  return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}""",
    "mg_f16_bits": """fn mg_f16_bits(x: f32) -> u32 {
  let u = bitcast<u32>(x);
  let a = u & 0x7fffffffu;
  let r = a - 0x38000000u;
  var bits = select(u32(round(bitcast<f32>(a) * 16777216.0)), (r + 0xfffu + ((r >> 13u) & 1u)) >> 13u,
                    a >= 0x38800000u);
  bits = select(bits, 0x7c00u, a >= 0x477ff000u);
  bits = select(bits, 0x7e00u, a > 0x7f800000u);
  return ((u >> 16u) & 0x8000u) | bits;
}""",
    "mg_round_bf16": "fn mg_round_bf16(x: f32) -> f32 { return mg_widen_bf16(mg_bf16_bits(x), 0u); }",
    "mg_round_f16": "fn mg_round_f16(x: f32) -> f32 { return mg_widen_f16(mg_f16_bits(x), 0u); }",
    "mg_pack_bf16": "fn mg_pack_bf16(a: f32, b: f32) -> u32 { return mg_bf16_bits(a) | (mg_bf16_bits(b) << 16u); }",
    "mg_pack_f16": "fn mg_pack_f16(a: f32, b: f32) -> u32 { return mg_f16_bits(a) | (mg_f16_bits(b) << 16u); }",
}
HELPERS.update(HALF_HELPERS)

HELPER_DEPS = {"mg_widen8_bf16": ["mg_widen4_bf16"], "mg_widen8_f16": ["mg_widen4_f16"],
               "mg_round_bf16": ["mg_widen_bf16", "mg_bf16_bits"], "mg_round_f16": ["mg_widen_f16", "mg_f16_bits"],
               "mg_pack_bf16": ["mg_bf16_bits"], "mg_pack_f16": ["mg_f16_bits"],
               "mg_exp": ["mg_exp_poly", "mg_ldexp_halves", "mg_isnan"],
               "mg_exp2": ["mg_exp_poly", "mg_ldexp_halves", "mg_isnan"], "mg_sinh": ["mg_exp", "mg_isnan"],
               "mg_cosh": ["mg_exp", "mg_isnan"], "mg_log": ["mg_log_parts", "mg_log_special"],
               "mg_log2": ["mg_log_parts", "mg_log_special"], "mg_log10": ["mg_log_parts", "mg_log_special"],
               "mg_log_special": ["mg_isnan", "mg_isinf"], "mg_log_parts": ["mg_log_reduce"],
               "mg_log2_parts": ["mg_log_reduce", "mg_hi12"],
               "mg_pow_positive": ["mg_log2_parts", "mg_hi12", "mg_exp_poly", "mg_ldexp_halves"],
               "mg_pow": ["mg_pow_positive", "mg_isnan", "mg_isinf"], "mg_sum2": ["mg_grid"],
               "mg_sum2_total": ["mg_isinf"],
               "mg_expm1": ["mg_exp"], "mg_log1p": ["mg_log"], "mg_sigmoid": ["mg_exp"],
               "mg_erf": ["mg_erf_series", "mg_erfc_abs", "mg_isnan"],
               "mg_erfc_abs": ["mg_hi12", "mg_ldexp_halves", "mg_erf_series"],
               "mg_erfc": ["mg_erfc_abs", "mg_isnan"], "mg_atan": ["mg_isnan"], "mg_atan2": ["mg_atan", "mg_isnan"],
               "mg_asin": ["mg_asin_poly", "mg_asin_far", "mg_isnan"], "mg_acos": ["mg_asin_poly", "mg_asin_far"],
               "mg_asin_far": ["mg_asin_poly"], "mg_max": ["mg_isnan"], "mg_min": ["mg_isnan"],
               "mg_tanh": ["mg_exp", "mg_isnan"], "mg_uniform": ["mg_hash"]}

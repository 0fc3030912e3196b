"""Logical dtypes, how the device stores them, and their host (numpy) form.

Every dtype computes in 32 bits on the device (f32, i32, or bool as u32). Storage is 32 bits too, except the half
precisions: bfloat16 and float16 are stored two to a u32 word (element 2k in the low half), widened to f32 when a
kernel loads them and rounded to nearest even when one stores them, so no adapter needs the ``shader-f16`` feature.
int64 is stored as int32 (inputs outside int32 are refused).

On the host, numpy has no bfloat16: a bfloat16 tensor is its raw bits, an ``np.uint16`` array of the same shape
(``bfloat16_bits`` and ``bfloat16_values`` convert from and to float32). float16 is ``np.float16``.
"""
from __future__ import annotations

import numpy as np

from meganeura.kernels.sizes import ceil_div

# Logical dtype -> storage kind on the device.
STORAGE = {"float32": "f32", "int32": "i32", "int64": "i32", "bool": "u32", "bfloat16": "bf16", "float16": "f16"}
HALF_STORAGE = ("bf16", "f16")
_ITEM_BYTES = {"f32": 4, "i32": 4, "u32": 4, "bf16": 2, "f16": 2}
# Storage kind -> the numpy dtype of its elements in host memory (what uploads send and downloads receive).
_HOST_ELEMENT = {"f32": np.dtype(np.float32), "i32": np.dtype(np.int32), "u32": np.dtype(np.uint32),
                 "bf16": np.dtype(np.uint16), "f16": np.dtype(np.float16)}
# Logical dtype -> the numpy dtype callers pass and get back.
HOST_DTYPE = {"float32": np.dtype(np.float32), "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
              "bool": np.dtype(np.bool_), "bfloat16": np.dtype(np.uint16), "float16": np.dtype(np.float16)}


def storage_bytes(numel: int, dtype: str) -> int:
    """Bytes a contiguous tensor of ``numel`` elements of logical ``dtype`` occupies on the device: whole u32 words."""
    return ceil_div(numel * _ITEM_BYTES[STORAGE[dtype]], 4) * 4


def host_words(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` (host form of logical ``dtype``) as the flat, contiguous element array the device stores, padded to
    whole u32 words (int64 narrowed to int32, bool to u32)."""
    kind = STORAGE[dtype]
    flat = np.ascontiguousarray(array, dtype=_HOST_ELEMENT[kind]).reshape(-1)
    if kind in HALF_STORAGE and flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, flat.dtype)])
    return flat


def from_storage(data, dtype: str, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
    """The tensor of logical ``dtype`` and ``shape`` read from device bytes ``data`` at byte ``offset``, in its host
    form."""
    numel = int(np.prod(shape, dtype=np.int64))
    if numel == 0:
        return np.empty(shape, dtype=HOST_DTYPE[dtype])
    words = np.frombuffer(data, _HOST_ELEMENT[STORAGE[dtype]], numel, offset).reshape(shape)
    if dtype == "int64":
        return words.astype(np.int64)
    if dtype == "bool":
        return words != 0
    return words


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even; NaN stays NaN), as raw np.uint16 bits."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def bfloat16_values(bits: np.ndarray) -> np.ndarray:
    """Raw bfloat16 bits (np.uint16) widened to float32 (exact)."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)

"""Exceptions raised by the meganeura runtime.

Every runtime failure derives from ``MeganeuraError`` so that callers can catch the whole family at once;
``InputError`` is also a ``ValueError`` because it reports a bad argument.
"""
from __future__ import annotations


class MeganeuraError(RuntimeError):
    """Base class of every error the runtime raises."""


class NoAdapterError(MeganeuraError):
    """No usable GPU adapter (or none matching the requested one)."""


class LimitError(MeganeuraError):
    """A tensor, binding, buffer or dispatch exceeds a limit of the device."""

    def __init__(self, message: str, *, limit: str, value: int, requested: int):
        super().__init__(message)
        self.limit = limit
        self.value = value
        self.requested = requested

    @classmethod
    def exceeded(cls, what: str, requested: int, limit: str, value: int, unit: str = "bytes") -> "LimitError":
        return cls(
            f"{what} needs {requested} {unit} but this adapter's {limit} is {value}",
            limit=limit,
            value=value,
            requested=requested,
        )


class FeatureError(MeganeuraError):
    """The device lacks a feature that a plan or bundle requires (e.g. shader-f16)."""

    def __init__(self, message: str, *, missing: list[str]):
        super().__init__(message)
        self.missing = missing


class BundleError(MeganeuraError):
    """A deploy bundle is malformed, truncated, inconsistent or of an unsupported format version."""


class InputError(MeganeuraError, ValueError):
    """A run was given a missing, unexpected or malformed input (name, shape, dtype or value range)."""


class DeviceLostError(MeganeuraError):
    """The GPU device was lost (driver reset, device destroyed); create a new one to continue."""


class KernelStatusError(MeganeuraError):
    """A kernel raised a status code, e.g. an index out of range; ``code`` holds the raw value."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code

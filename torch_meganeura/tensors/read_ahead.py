"""Read-ahead of device values that eager code reads one tensor after another.

``state_dict()``, ``torch.save`` and checkpoint loops read a model's tensors one at a time; a download per tensor
waits for the queue once per tensor (161 waits for a kept ResNet-50's parameters). A ``ReadAhead`` groups tensors that
one device run makes stale together (a kept optimizer's parameters; the buffers one graph updates): after the run
(``restart``), the first read of a stale member downloads that member alone, and each further read downloads it with
twice as many of the group's other stale members as the read before, in one wait. Reading all n members, in any
order, then takes about log2(n) waits; reading one member costs that member's bytes; reading k members downloads at
most 2^k - 1 (bounded by the group and ``READ_AHEAD_MAX_BYTES``). Members are taken in the group's order from the one
read, wrapping around: the order in which the run met them (the optimizer's parameter order, which ``state_dict``
follows; a graph's arguments).
"""
from __future__ import annotations

import weakref

# A batch stops growing past this many bytes: one staging buffer of at most this size on the device and on the host
# (a 1B-parameter model's state_dict in f32 then takes about 16 waits at the cap, not thousands).
READ_AHEAD_MAX_BYTES = 256 << 20


class ReadAhead:
    """Members in the order a run met them; ``batch`` chooses what a download of one of them brings along."""

    def __init__(self, members):
        self._refs = [weakref.ref(member) for member in members]
        self._window = 1  # members the next read downloads

    def restart(self) -> None:
        """The members are stale again (a run updated them): the next read downloads one."""
        self._window = 1

    def batch(self, member, position: int, stale_bytes) -> list:
        """``member`` (at ``position``) and the next members in the group's order (wrapping around) for which
        ``stale_bytes(m)`` (bytes to download, 0 for none) says they are stale, ``window`` members in all at most
        and ``READ_AHEAD_MAX_BYTES``; a member that is not at its position (another tensor took its place) is read
        alone."""
        refs = self._refs
        if position >= len(refs) or refs[position]() is not member:
            return [member]
        window, self._window = self._window, 2 * self._window
        chosen, total = [member], stale_bytes(member)
        for step in range(1, len(refs)):
            if len(chosen) == window:
                break
            other = refs[(position + step) % len(refs)]()
            size = stale_bytes(other) if other is not None else 0
            if size and total + size > READ_AHEAD_MAX_BYTES:
                break
            if size:
                chosen.append(other)
                total += size
        return chosen

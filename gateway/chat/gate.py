"""A gate in front of the engine: hold new requests (never fail them) and drain
in-flight ones, so a colocated trainer can have the GPU for a moment. Background work inside
(shadow samples, the `self` judge's calls) watches `closing` and leaves at once: it can be redone,
so the trainer waits only for the live calls. Once: redone, it stays, and the next handover waits
for it too (back-to-back steps would otherwise call it off for ever)."""

from __future__ import annotations

import asyncio


class RequestGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = asyncio.Event()  # set from close_and_drain until open
        self.held = 0  # requests waiting at the gate right now

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def wait(self) -> None:
        """Return once the gate is open (at once, normally)."""
        if self._open.is_set():
            return
        self.held += 1
        try:
            await self._open.wait()
        finally:
            self.held -= 1

    async def closing(self) -> None:
        """Return once the gate starts closing (a trainer is waiting for the drain)."""
        await self._closing.wait()

    def passage(self) -> _Passage:
        """`async with gate.passage():` wait at the gate, then count as in flight until the block ends."""
        return _Passage(self)

    def _enter(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def close_and_drain(self) -> None:
        """Stop letting requests through and wait for those inside to finish."""
        self._open.clear()
        self._closing.set()
        await self._idle.wait()

    def open(self) -> None:
        self._closing.clear()
        self._open.set()


class _Passage:
    """One request through the gate. A class rather than an `asynccontextmanager`: every call
    goes through it, and an async generator costs six times as much to enter and leave."""

    __slots__ = ("_gate",)

    def __init__(self, gate: RequestGate):
        self._gate = gate

    async def __aenter__(self) -> None:
        await self._gate.wait()
        self._gate._enter()

    async def __aexit__(self, *exc_info) -> None:
        self._gate._leave()

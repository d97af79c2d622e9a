"""The latest instance-state snapshot, and a way for any number of watchers to await the next one."""

from __future__ import annotations

import asyncio

from routerd.api.v1.instance_state_pb2 import InstanceState

__all__ = ["StateBoard"]


class StateBoard:
    """Holds the latest :class:`InstanceState` and wakes every waiter when a newer one is posted.

    Single event loop only. Watchers hold no task or queue of their own here, only an
    await on a shared event, so a watcher that goes away (its task cancelled) leaves
    nothing behind, and a slow watcher skips to the latest snapshot instead of
    accumulating a backlog.
    """

    def __init__(self, initial: InstanceState) -> None:
        self._latest = initial
        self._posted = asyncio.Event()
        self._closed = asyncio.Event()

    @property
    def latest(self) -> InstanceState:
        """The most recently posted snapshot (the initial one until the first post)."""
        return self._latest

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed.is_set()

    def post(self, state: InstanceState) -> None:
        """Make ``state`` the latest snapshot and wake every waiter."""
        self._latest = state
        # A fresh event per post: waiters woken by this one see the new state, and later
        # waiters block until the next post.
        posted, self._posted = self._posted, asyncio.Event()
        posted.set()

    def close(self) -> None:
        """End every :meth:`wait_newer` and :meth:`sleep` (they return None / at once); used at shutdown."""
        self._closed.set()
        self._posted.set()

    async def wait_newer(self, sequence: int) -> InstanceState | None:
        """The latest snapshot once its ``sequence`` is above ``sequence``; None when the board is closed."""
        while self._latest.sequence <= sequence:
            if self._closed.is_set():
                return None
            await self._posted.wait()
        return None if self._closed.is_set() else self._latest

    async def sleep(self, delay_s: float) -> bool:
        """Sleep ``delay_s`` seconds, or less if the board is closed meanwhile; returns False when closed."""
        if delay_s > 0 and not self._closed.is_set():
            try:
                async with asyncio.timeout(delay_s):
                    await self._closed.wait()
            except TimeoutError:
                pass
        return not self._closed.is_set()

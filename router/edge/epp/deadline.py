"""A deadline on the task that runs one ext_proc stream (:class:`Deadline`): one timer for a
whole phase, pushed back by each message where the phase allows silence between messages, so a
read costs no task and no timer of its own (``asyncio.wait_for`` would add both to every read
of every chunk). Python 3.10's tasks cannot be uncancelled; there a fired deadline still ends
the phase, as it should."""

from __future__ import annotations

import asyncio
import sys

__all__ = ["Deadline"]


class Deadline:
    """Cancels the current task once ``timeout`` seconds pass with no :meth:`push`; the phase
    catches the ``CancelledError`` and asks :meth:`fired` whether it was this deadline's."""

    def __init__(self, timeout: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._loop = asyncio.get_running_loop()
        self.timeout = timeout
        self.at = self._loop.time() + timeout
        self.expired = False
        self._handle = self._loop.call_later(timeout, self._check)

    def push(self) -> None:
        """A message came: the silence allowed starts again (one float write)."""
        self.at = self._loop.time() + self.timeout

    def _check(self) -> None:
        left = self.at - self._loop.time()
        if left > 0:
            self._handle = self._loop.call_later(left, self._check)
            return
        self.expired = True
        self._task.cancel()

    def fired(self) -> bool:
        """In an ``except CancelledError``: True when the cancel was this deadline's (then it
        is taken back, and the phase handles it); False: someone else's, re-raise it."""
        if not self.expired:
            return False
        if sys.version_info >= (3, 11):
            self._task.uncancel()
        return True

    def cancel(self) -> None:
        self._handle.cancel()

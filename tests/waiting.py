"""The one way the tests wait for state: poll a condition until it holds, fail after a timeout.
Never a sleep for a state to arrive (a test that sleeps is either slow or flaky).

``wait_for`` for tests on the event loop; ``poll`` for plain threads and subprocess tests (it
returns the condition's truthy value, and lets the condition's exceptions through)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvrouter.up import UpError, wait_until

__all__ = ["poll", "wait_for"]


async def wait_for(cond: Callable[[], Any], timeout: float = 20.0, what: str = "") -> None:
    """Poll ``cond`` every 5 ms until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        await asyncio.sleep(0.005)


def poll(
    cond: Callable[[], Any], timeout: float = 20.0, what: str = "", every: float = 0.05
) -> Any:
    """Call ``cond`` every ``every`` seconds until it returns something truthy, and return that;
    fail the test after ``timeout`` seconds (:func:`kvrouter.up.wait_until`'s loop, its
    timeout a test failure)."""
    try:
        return wait_until(cond, timeout, what or str(cond), every)
    except UpError as e:
        raise AssertionError(str(e)) from None

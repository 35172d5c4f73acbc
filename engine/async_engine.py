"""The bridge between the asyncio server and the synchronous engine core.

One thread ("engine loop") owns the :class:`LLMEngine` and the event publisher: it takes commands
from an inbox (add, abort, call), steps the engine while it has work, publishes each step's KV
events as one batch, and hands outputs to the waiting request coroutines through their event
loop. Steps block (the sim sleeps, torch computes), which is why this is a thread and not a task;
request handlers never touch the core, they post commands and await the answers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.engine import EngineStats, LLMEngine, RequestOutput
from engine.publisher import EventPublisher
from engine.sequence import Request

__all__ = ["AsyncEngine", "EngineDeadError"]

log = logging.getLogger("engine.loop")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a runner failure); the server answers 503 from then on."""


@dataclass
class _Add:
    req: Request
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    fut: concurrent.futures.Future[Any]


class AsyncEngine:
    def __init__(self, core: LLMEngine, publisher: EventPublisher | None = None) -> None:
        self.core = core
        self.publisher = publisher
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Add] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        #: Refreshed by the loop after every iteration; read by /metrics without a round trip.
        self.stats: EngineStats = core.stats()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ------------------------------------------------------------------ API for handlers

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit ``req`` and yield its outputs; leaving early (client gone) aborts it."""
        if not self.alive:
            raise EngineDeadError(f"the engine loop is not running ({self.error})")
        out: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._post(_Add(req, asyncio.get_running_loop(), out))
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._post(_Abort(req.request_id))

    def abort(self, request_id: str) -> None:
        self._post(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(core)`` on the engine thread between steps and return its result."""
        if not self.alive:
            raise EngineDeadError(f"the engine loop is not running ({self.error})")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(_Call(fn, fut))
        return await asyncio.wrap_future(fut)

    def _post(self, cmd: _Add | _Abort | _Call) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            while True:
                if not self._drain_inbox():
                    break
                if self.core.has_work:
                    outputs = self.core.step()
                    self._publish()
                    self._deliver(outputs)
                    if not outputs and not self.core.scheduler.running:
                        self._wake.wait(0.0005)  # only copies in flight
                        self._wake.clear()
                else:
                    self.core.leases.expire()  # an idle prefill engine ends leases too
                    self._publish()
                    self.stats = self.core.stats()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self.stats = self.core.stats()
        except BaseException as exc:
            self.error = exc
            log.exception("engine loop failed")
            for add in list(self._streams.values()):
                self._send(add, EngineDeadError(f"engine failed: {exc}"))
            self._streams.clear()
        finally:
            self._fail_pending()
            self._publish()

    def _drain_inbox(self) -> bool:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if cmd is None:
                return False
            if isinstance(cmd, _Add):
                try:
                    self.core.add_request(cmd.req)
                except Exception as exc:
                    self._send(cmd, exc)
                    continue
                self._streams[cmd.req.request_id] = cmd
            elif isinstance(cmd, _Abort):
                if self._streams.pop(cmd.request_id, None) is not None:
                    self.core.abort(cmd.request_id)
            else:
                try:
                    cmd.fut.set_result(cmd.fn(self.core))
                except Exception as exc:
                    cmd.fut.set_exception(exc)
                self._publish()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            add = self._streams.get(o.request_id)
            if add is None:
                continue
            if o.finished:
                del self._streams[o.request_id]
            self._send(add, o)

    @staticmethod
    def _send(add: _Add, item: RequestOutput | BaseException) -> None:
        try:
            add.loop.call_soon_threadsafe(add.out.put_nowait, item)
        except RuntimeError:  # that event loop is closed: nobody is listening
            pass

    def _publish(self) -> None:
        events = self.core.drain_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _fail_pending(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._send(cmd, EngineDeadError("the engine is shutting down"))
            elif isinstance(cmd, _Call):
                cmd.fut.set_exception(EngineDeadError("the engine is shutting down"))
        for add in self._streams.values():
            self._send(add, EngineDeadError("the engine is shutting down"))
        self._streams.clear()

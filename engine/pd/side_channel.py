"""The prefill engine's block endpoint and the decode engine's pull (vLLM: the NIXL side channel
at ``VLLM_NIXL_SIDE_CHANNEL_HOST:PORT``, then an RDMA read; here one TCP exchange carries both).

Why an endpoint of the engine and not the EXTERNAL pool: the pull is point to point and read once
(a lease, released on the pull), its blocks need no copy in a third store nor a store at all, and
it is what vLLM's NixlConnector does, so the router's ``nixl`` protocol drives it unchanged. The
endpoint listens on its own address (``--kv-host``/``--kv-port``), so an operator binds it to the
engines' side network only: being able to reach it is the authentication, as with NIXL's. What the
decode engine is told to connect to (``remote_host``) is :func:`advertised_host`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

from engine.pd.params import KvTransferError
from engine.pd.wire import (
    MAX_REQUEST_BYTES,
    PullAnswer,
    PullRequest,
    answer_limit,
    read_frame,
    write_frame,
)
from indexer.hosts import is_wildcard

__all__ = ["BlockEndpoint", "advertised_host", "pull"]

log = logging.getLogger("engine.pd")

#: pulls served at once; more wait (each holds its blocks' bytes in memory while it is sent)
MAX_CONCURRENT_PULLS = 4

#: seconds a connected peer has to send its request
REQUEST_TIMEOUT_S = 10.0

Export = Callable[[PullRequest], Awaitable[PullAnswer]]


class BlockEndpoint:
    """The prefill engine's side of a pull: ``export`` reads the lease's blocks (on the engine
    thread); this serves it to whoever connects."""

    def __init__(self, export: Export, *, host: str, port: int) -> None:
        self._export = export
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_PULLS)
        self.served = 0
        #: pulls answered with an error, by :data:`engine.pd.params.FAILURE_REASONS`
        self.refused: dict[str, int] = {}

    async def start(self) -> BlockEndpoint:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.host, self.port = self._server.sockets[0].getsockname()[:2]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with self._slots:
                try:
                    # a peer that connects and says nothing must not hold a slot for good
                    req = await asyncio.wait_for(
                        read_frame(reader, PullRequest, MAX_REQUEST_BYTES), REQUEST_TIMEOUT_S
                    )
                    answer = await self._export(req)
                except KvTransferError as exc:
                    answer = PullAnswer(error=str(exc))
                    self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
                    log.warning("KV pull refused: %s", answer.error)
                else:
                    self.served += 1
                await write_frame(writer, answer)
        except asyncio.TimeoutError:
            log.warning("KV pull from %s sent no request", writer.get_extra_info("peername"))
        except (ConnectionError, OSError) as exc:  # the decode engine left mid-answer
            log.warning("KV pull from %s broke: %s", writer.get_extra_info("peername"), exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


def advertised_host(bound: str, given: str | None = None) -> str:
    """The address a prefill answer's ``remote_host`` names: ``given`` (``--kv-advertise-host``),
    else the endpoint's ``bound`` host when it is one address; a wildcard bind (``0.0.0.0``,
    ``::``) is no address a peer can connect to, so then this host's own address (the pod IP in
    Kubernetes), or loopback if it has none (vLLM: ``VLLM_NIXL_SIDE_CHANNEL_HOST``). Of the
    bind's family: asyncio binds ``::`` IPv6 only, where an IPv4 address would be refused."""
    if given:
        return given
    if not is_wildcard(bound):
        return bound
    v6 = ":" in bound
    loopback = "::1" if v6 else "127.0.0.1"
    try:
        if v6:
            own = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET6)[0][4][0]
        else:
            own = socket.gethostbyname(socket.gethostname())
    except (OSError, IndexError) as exc:
        log.warning("no address for this host (%s): advertising blocks on %s", exc, loopback)
        return loopback
    return loopback if is_wildcard(own) else own


async def pull(
    host: str, port: int, req: PullRequest, *, block_bytes: int, timeout: float
) -> PullAnswer:
    """The decode engine's side: the answer to ``req``, whose blocks must be ``block_bytes``
    each; :class:`KvTransferError` if the prefill engine cannot be reached, refuses, answers
    another number or size of blocks, or goes away mid-pull."""
    want = len(req.block_ids) - req.first
    limit = answer_limit(max(want, 0), block_bytes, len(req.block_ids))

    # an IPv6 remote_host may come bracketed, as in a URL; the socket wants the bare address
    addr = host[1:-1] if host.startswith("[") and host.endswith("]") else host

    async def exchange() -> PullAnswer:
        reader, writer = await asyncio.open_connection(addr, port)
        try:
            await write_frame(writer, req)
            return await read_frame(reader, PullAnswer, limit)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    try:
        answer = await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError as exc:
        raise KvTransferError(
            f"KV pull from {host}:{port} timed out after {timeout:g} s", "timeout"
        ) from exc
    except (ConnectionError, OSError) as exc:
        raise KvTransferError(f"KV pull from {host}:{port} failed: {exc}", "unreachable") from exc
    if answer.error is not None:
        raise KvTransferError(
            f"the prefill engine at {host}:{port} refused: {answer.error}", "refused"
        )
    if len(answer.blocks) != want or len(answer.block_hashes) != len(req.block_ids):
        raise KvTransferError(
            f"asked {want} blocks of {len(req.block_ids)}, got {len(answer.blocks)} "
            f"(and {len(answer.block_hashes)} hashes)",
            "block_mismatch",
        )
    bad = [i for i, b in enumerate(answer.blocks) if len(b) != block_bytes]
    if bad:
        raise KvTransferError(
            f"block {bad[0]} is {len(answer.blocks[bad[0]])} bytes, this engine's are "
            f"{block_bytes}",
            "block_mismatch",
        )
    return answer

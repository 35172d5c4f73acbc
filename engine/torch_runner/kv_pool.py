"""The KV block pool on the compute device and its host (CPU_PINNED) counterpart, and the real
byte moves between them.

Device pool: one allocation ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; each layer
is the view ``[2, num_blocks, ...]`` attention works on. Host pool: slot-major
``[num_slots, layers, 2, block_size, kv_heads, head_dim]`` so one host slot is one contiguous
chunk: a single non-blocking DMA per slot, and a zero-copy view to export as bytes for DISK and
EXTERNAL. On CUDA, copies run on a side stream (after an event from the compute stream, so the
KV being copied out has been written), timed by a pair of events; the engine polls
:meth:`CopyHandle.done` and reports the tier event only after it. The engine never touches a
transfer's blocks while it is pending (runner contract in ``engine.runner.base``), so compute is
not fenced against copies and they overlap the next steps. On CPU copies are synchronous and
complete on return.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.runner.base import Transfer

from .config import ModelConfig

__all__ = ["CopyHandle", "KVPool"]


class CopyHandle(Transfer):
    """Completion of one batch of block copies; ``elapsed_s`` is measured (CUDA event timing on
    the side stream, wall time on CPU)."""

    def __init__(
        self,
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
        keep: tuple = (),
        elapsed_s: float = 0.0,
    ) -> None:
        self._events = events
        self._keep = keep  # tensors the side stream still reads or writes
        self.elapsed_s = elapsed_s

    def done(self) -> bool:
        if self._events is None:
            return True
        start, end = self._events
        if not end.query():
            return False
        self.elapsed_s = start.elapsed_time(end) / 1000.0
        self._events, self._keep = None, ()
        return True

    def wait(self) -> None:
        if self._events is not None:
            self._events[1].synchronize()
            self.done()


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Group (src, dst) pairs into (src_start, dst_start, length) runs of consecutive slots."""
    out: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        num_host_slots: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_slots = num_host_slots
        shape = (block_size, cfg.num_kv_heads, cfg.head_dim)
        self.gpu = torch.zeros(
            cfg.num_layers, 2, num_blocks, *shape, dtype=dtype, device=self.device
        )
        self.layers: list[torch.Tensor] = list(self.gpu.unbind(0))
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(
            num_host_slots, cfg.num_layers, 2, *shape, dtype=dtype, pin_memory=cuda
        )
        #: bytes of one block over all layers: one host slot, one exported blob
        self.block_bytes = cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim
        self.block_bytes *= self.gpu.element_size()
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._pending: list[CopyHandle] = []

    # -- device <-> host ------------------------------------------------------------------------

    def copy_out(self, pairs: Sequence[tuple[int, int]]) -> CopyHandle:
        """Copy device blocks to host slots: ``pairs`` of (device block, host slot)."""
        if not pairs:
            return CopyHandle()
        t0 = time.perf_counter()
        blocks = torch.tensor([b for b, _ in pairs], dtype=torch.long, device=self.device)
        if self._stream is None:
            staged = self.gpu.index_select(2, blocks).movedim(2, 0)
            self.host[torch.tensor([s for _, s in pairs])] = staged
            return CopyHandle(elapsed_s=time.perf_counter() - t0)
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self._stream):
            start = self._begin(ready)  # the KV being copied was written on the compute stream
            blocks.record_stream(self._stream)
            staged = self.gpu.index_select(2, blocks).movedim(2, 0).contiguous()
            for src, dst, n in _runs([(i, s) for i, (_, s) in enumerate(pairs)]):
                self.host[dst : dst + n].copy_(staged[src : src + n], non_blocking=True)
            return self._finish(start, (staged, blocks))

    def copy_in(self, pairs: Sequence[tuple[int, int]]) -> CopyHandle:
        """Copy host slots into device blocks: ``pairs`` of (host slot, device block)."""
        if not pairs:
            return CopyHandle()
        t0 = time.perf_counter()
        blocks = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)
        if self._stream is None:
            staged = self.host[torch.tensor([s for s, _ in pairs])].movedim(0, 2)
            self.gpu.index_copy_(2, blocks, staged)
            return CopyHandle(elapsed_s=time.perf_counter() - t0)
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self._stream):
            start = self._begin(ready)  # earlier compute may still read the target blocks
            blocks.record_stream(self._stream)
            staged = torch.empty(
                (len(pairs), *self.host.shape[1:]), dtype=self.dtype, device=self.device
            )
            for src, dst, n in _runs([(s, i) for i, (s, _) in enumerate(pairs)]):
                staged[dst : dst + n].copy_(self.host[src : src + n], non_blocking=True)
            self.gpu.index_copy_(2, blocks, staged.movedim(0, 2))
            return self._finish(start, (staged, blocks))

    def copy_device(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device block to device block (copy-on-write of a shared partial block)."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
            dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
            self.gpu.index_copy_(2, dst, self.gpu.index_select(2, src))

    def _begin(self, ready: torch.cuda.Event) -> torch.cuda.Event:
        assert self._stream is not None
        self._stream.wait_event(ready)
        start = torch.cuda.Event(enable_timing=True)
        start.record(self._stream)
        return start

    def _finish(self, start: torch.cuda.Event, keep: tuple) -> CopyHandle:
        assert self._stream is not None
        end = torch.cuda.Event(enable_timing=True)
        end.record(self._stream)
        handle = CopyHandle((start, end), keep)
        self._pending = [h for h in self._pending if not h.done()]
        self._pending.append(handle)
        return handle

    def synchronize(self) -> None:
        """Wait for every copy issued so far."""
        for handle in self._pending:
            handle.wait()
        self._pending.clear()

    # -- host slot <-> bytes (DISK, EXTERNAL) ---------------------------------------------------

    def export_slot(self, slot: int) -> bytes:
        """The host slot's raw bytes (``block_bytes`` long): a copy, safe to keep."""
        return self.host[slot].reshape(-1).view(torch.uint8).numpy().tobytes()

    def import_slot(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if len(view) != self.block_bytes:
            raise ValueError(f"block bytes: got {len(view)}, expected {self.block_bytes}")
        # bytearray: frombuffer needs a writable buffer
        src = torch.frombuffer(bytearray(view), dtype=torch.uint8)
        self.host[slot].reshape(-1).view(torch.uint8).copy_(src)

"""The owner's answers on one peer connection: a frame per chunk (or an error), and a pulse
whenever PULSE_S passes without a frame while a fetch is in progress.

A chunk costs the owner's event loop one hop to a worker thread and back in the common case:
the thread seals (or, on a plain connection, the event loop sends) the frame's header and
then its payload, as much as the socket takes; only a socket that fills brings it back to
the event loop to wait, bounded by the stall budget. The header still goes out as its own
send, ahead of the payload, so the reader's open returns while the payload is on its way.

The pulses come from one task per connection that sleeps until a fetch has gone PULSE_S
without a frame: it is not started, woken or joined per fetch (its wake-up time is a cancel
scope's deadline, moved as a fetch begins and ends), so a fast fetch costs it nothing.
"""

from __future__ import annotations

import math
from typing import Callable

import msgspec
import trio

from kvfs.errors import KvfsError
from kvfs.net.streams import FrameStream, Socket, TlsStream, send_some
from kvfs.wire.protocol import ErrorReply, FrameKind, encode_frame

PULSE_S = 1.0
SEND_STALL_S = 10.0  # the owner drops a reader that takes no data this long


class ChunkData(msgspec.Struct, tag=True):
    index: int
    length: int
    pieces: list[int] = []  # the writer's checksum of each PIECE_SIZE piece, if the owner has them


class Pulse(msgspec.Struct, tag=True):
    """Sent while the owner prepares the next chunk (its own frame kind, `FrameKind.PULSE`)."""


async def take(lock: trio.Lock | trio.CapacityLimiter) -> None:
    """Acquires LOCK without a trip through the scheduler when it is free (the common case
    on the serving path, which yields at its socket waits and thread hops anyway)."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


def send_frame_some(sock: Socket, header: memoryview, payload: memoryview) -> tuple[memoryview, memoryview]:
    """Sends what the non-blocking socket takes now of a frame, header first (as a send of
    its own, so that it is not held back behind the payload); returns what is left of each.
    Call again with what it returned once the socket is writable (`send_some`'s contract)."""
    if len(header):
        header = header[send_some(sock, header):]
        if len(header):
            return header, payload
    if len(payload):
        payload = payload[send_some(sock, payload):]
    return header, payload


class Answers:
    """The answers of one connection's fetches, one fetch at a time (`begin` .. `end`)."""

    def __init__(self, frames: FrameStream, sent: Callable[[int], None], threads: trio.CapacityLimiter,
                 stall_s: float = SEND_STALL_S) -> None:
        assert isinstance(frames.stream, TlsStream)  # (with TLS, or sealed or plain once unwrapped)
        self.frames = frames
        self.request_id = 0
        self._socket = frames.stream.socket
        self._threads = threads
        self.stall_s = stall_s
        self._sending = trio.Lock()  # one frame at a time: a chunk's, an error's or a pulse
        self._serving = False  # between begin and end
        self._last_sent = 0.0
        self._timer = trio.CancelScope()  # the pulse task's sleep; its deadline is when it looks next
        self._sent = sent  # payload bytes, as each chunk goes out

    def begin(self, request_id: int) -> None:
        self.request_id = request_id
        self._serving = True
        self._last_sent = trio.current_time()
        self._timer.deadline = self._last_sent + PULSE_S

    def end(self) -> None:
        self._serving = False
        self._timer.deadline = math.inf

    async def chunk(self, index: int, data: memoryview | bytes, pieces: list[int] | None = None) -> None:
        payload = memoryview(data).cast("B")
        header = encode_frame(FrameKind.RESPONSE, self.request_id, ChunkData(index, len(payload), pieces or []),
                              len(payload))
        await take(self._sending)
        try:
            await self._frame(memoryview(header), payload)
            self._last_sent = trio.current_time()
        finally:
            self._sending.release()
        self._sent(len(payload))

    async def _frame(self, header: memoryview, payload: memoryview) -> None:
        """The frame, sealed (or, unwrapped, copied) in a worker thread for as long as the socket
        takes data; while it is full, this waits in the event loop (a reader that stops reading
        holds no thread). A plaintext connection has nothing to encrypt: what its socket takes
        at once (a whole 2 MiB chunk, with the socket buffers the peer server sets) is sent from
        the event loop, with no hop to a worker thread and back."""
        if self.frames.plaintext:
            header, payload = send_frame_some(self._socket, header, payload)
            if not (len(header) or len(payload)):
                return await trio.lowlevel.checkpoint()  # (a batch's chunks must not hog the loop)
        while True:
            header, payload = await trio.to_thread.run_sync(send_frame_some, self._socket, header, payload,
                                                            limiter=self._threads)
            if not (len(header) or len(payload)):
                return
            with trio.move_on_after(self.stall_s) as stalled:
                await trio.lowlevel.wait_writable(self._socket)
            if stalled.cancelled_caught:  # a frame may be cut: the connection is done
                raise TimeoutError(f"the peer took no data for {self.stall_s:g} s")

    async def error(self, error: KvfsError) -> None:
        async with self._sending:
            await self.frames.send(FrameKind.ERROR, self.request_id, ErrorReply(error.errno, str(error)))
            self._last_sent = trio.current_time()

    async def pulse_while_serving(self) -> None:
        """Runs for the connection's life: a pulse whenever a fetch has gone PULSE_S without a
        frame. Raises TimeoutError when the peer takes no pulse for the stall budget."""
        while True:
            with trio.CancelScope() as timer:
                self._timer = timer  # (begin and end move its deadline; it may have moved meanwhile)
                timer.deadline = self._last_sent + PULSE_S if self._serving else math.inf
                await trio.sleep_forever()
            if not self._serving or trio.current_time() - self._last_sent < PULSE_S:
                continue  # a frame went out meanwhile, or the fetch ended
            async with self._sending:
                if not self._serving or trio.current_time() - self._last_sent < PULSE_S:
                    continue
                with trio.move_on_after(self.stall_s) as stalled:
                    await self.frames.send(FrameKind.PULSE, self.request_id, Pulse())
                if stalled.cancelled_caught:  # a frame may be cut: the connection is done
                    raise TimeoutError(f"the peer took no data for {self.stall_s:g} s")
                self._last_sent = trio.current_time()

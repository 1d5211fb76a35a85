"""The owner's answers on one peer connection: a frame per chunk (or an error), and a pulse
whenever PULSE_S passes without a frame while a fetch is in progress.

A request's frames (a run's chunks, a batch's runs, their error frames) cost the owner's
event loop one hop to a worker thread and back in the common case, however many there are
(`frames_out`): the thread seals each frame's header and then its payload, as much as the
socket takes, waiting for room while a full socket drains (up to THREAD_WAIT_S at a time);
only a socket that stays full brings it back to the event loop to wait, bounded by the stall
budget. Each header still goes out as a send of its own, ahead of its payload, so the
reader's open returns while the payload is on its way. On a plain connection there is
nothing to seal: the event loop hands the socket the frames itself, with no hop at all, each
payload gathered with the next frame's header in one `sendmsg`.

The pulses come from one task per connection that sleeps until a fetch has gone PULSE_S
without a frame: it is not started, woken or joined per fetch (its wake-up time is a cancel
scope's deadline, moved as a fetch begins and ends), so a fast fetch costs it nothing.
"""

from __future__ import annotations

import math
import select
import socket
from typing import Callable

import msgspec
import trio

from kvfs.errors import KvfsError
from kvfs.net.hop import in_thread
from kvfs.net.streams import FrameStream, Socket, TlsStream, send_some
from kvfs.wire.protocol import ErrorReply, FrameKind, encode_frame

PULSE_S = 1.0
SEND_STALL_S = 10.0  # the owner drops a reader that takes no data this long
# How long a worker thread waits for room in a full socket before it hands the wait to the event
# loop: a reader that is reading makes room within it (the socket drains in well under 1 ms a
# MiB on a live reader), and a send thread never waits on a stopped one for longer.
THREAD_WAIT_S = 0.005


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


def send_views_some(sock: Socket, views: list[memoryview], at: int) -> int:
    """Sends views[at:] in order, each as a send of its own (a header is not held back behind
    the payload before it is sealed), as much as the non-blocking socket takes now. Returns
    the index of the first view not sent whole (len(views): all went), having left in its
    place what is left of it; call again with that index once the socket is writable."""
    while at < len(views):
        view = views[at]
        if len(view):
            sent = send_some(sock, view)
            if sent < len(view):
                views[at] = view[sent:]
                return at
        at += 1
    return at


def send_views_waiting(sock: Socket, views: list[memoryview], at: int, wait_s: float = THREAD_WAIT_S) -> int:
    """`send_views_some`, for a worker thread: while the socket is full, it waits up to
    `wait_s` at a time for room before it gives up and returns (the event loop waits then).
    A reader that keeps reading costs one call, not one per time the socket filled; one that
    stops holds the thread no longer than `wait_s`."""
    poller: select.poll | None = None
    while True:
        at = send_views_some(sock, views, at)
        if at == len(views):
            return at
        if poller is None:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLOUT)
        if not poller.poll(wait_s * 1000):
            return at


def sendmsg_some(sock: socket.socket, views: list[memoryview], at: int) -> int:
    """`send_views_some` for a plain socket, whose views are frames' (header, payload) pairs: a
    payload and the next frame's header go in one `sendmsg`, so that every header still ends
    its send and reaches the reader before its own payload is copied (gathered with it, the
    kernel pushed it only after most of a 2 MiB payload). N frames: N + 1 sends, not 2N."""
    while at < len(views):
        stop = min(at + 1 if at % 2 == 0 else at + 2, len(views))  # (a header alone ends a send)
        try:
            sent = sock.sendmsg(views[at:stop])
        except BlockingIOError:
            return at
        while at < stop and sent >= len(views[at]):
            sent -= len(views[at])
            at += 1
        if at < stop:  # the socket took part of them: it is full
            views[at] = views[at][sent:]
            return at
    return at


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
        self._sent = sent  # payload bytes, as each request's chunks go out

    def begin(self, request_id: int) -> None:
        self.request_id = request_id
        self._serving = True
        self._last_sent = trio.current_time()
        self._timer.deadline = self._last_sent + PULSE_S

    def end(self) -> None:
        self._serving = False
        self._timer.deadline = math.inf

    def chunk_frame(self, index: int, data: memoryview | bytes, pieces: list[int] | None = None
                    ) -> tuple[memoryview, memoryview]:
        """A chunk's frame for `frames_out`: its encoded header and its payload (a view, no copy)."""
        payload = memoryview(data).cast("B")
        header = encode_frame(FrameKind.RESPONSE, self.request_id, ChunkData(index, len(payload), pieces or []),
                              len(payload))
        return memoryview(header), payload

    def error_frame(self, error: KvfsError) -> tuple[memoryview, memoryview]:
        """An error frame for `frames_out` (it ends one run of a batch), with its empty payload."""
        header = encode_frame(FrameKind.ERROR, self.request_id, ErrorReply(error.errno, str(error)))
        return memoryview(header), memoryview(b"")

    async def chunk(self, index: int, data: memoryview | bytes, pieces: list[int] | None = None) -> None:
        header, payload = self.chunk_frame(index, data, pieces)
        await self.frames_out([header, payload], len(payload))

    async def frames_out(self, views: list[memoryview], payload_bytes: int) -> None:
        """Sends the views (frames' header and payload pairs, in order) as one: one worker call while
        the socket takes them. `payload_bytes` is counted as served once they are out. The
        views must stay valid until this returns."""
        await take(self._sending)
        try:
            await self._send(views)
            self._last_sent = trio.current_time()
        finally:
            self._sending.release()
        self._sent(payload_bytes)

    async def _send(self, views: list[memoryview]) -> None:
        """The views, sealed in a worker thread for as long as the socket takes data (or makes
        room within THREAD_WAIT_S); while it stays full, this waits in the event loop (a reader
        that stops reading holds no thread). A plaintext connection has nothing to seal: the
        event loop hands the socket the views itself (`sendmsg_some`), with no hop at all."""
        at, waited = 0, False
        while True:
            if self.frames.plaintext:
                at = sendmsg_some(self._socket, views, at)  # type: ignore[arg-type]
            else:
                at = await in_thread(self._threads, send_views_waiting, self._socket, views, at)
            if at == len(views):
                if self.frames.plaintext and not waited:
                    await trio.lowlevel.checkpoint()  # (a batch's requests must not hog the loop)
                return
            self._last_sent = trio.current_time()  # (bytes went: no pulse is due for them yet)
            with trio.move_on_after(self.stall_s) as stalled:
                await trio.lowlevel.wait_writable(self._socket)
            waited = True
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

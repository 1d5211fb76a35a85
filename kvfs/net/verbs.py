"""RDMA verbs through pyverbs: device discovery, memory regions, RC queue pairs, one-sided
READs, and completions delivered to trio through the completion channel's file descriptor.

pyverbs comes from Debian's `python3-pyverbs` (the PyPI sdist does not build); it
is optional: `probe()` says why RDMA cannot be used instead of failing. Nothing
here busy-polls: a trio task sleeps in `wait_readable` on the channel fd, then
drains the completion queue and wakes the tasks whose READs completed.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger(__name__)

SYSFS = Path("/sys/class/infiniband")
CQ_ENTRIES = 1024
MAX_READS_IN_FLIGHT = 64  # per queue pair (send queue depth)
READ_TIMEOUT_S = 10.0  # a 4 MiB READ takes under a millisecond on a NIC, 0.3 s in the emulated test VM


class RdmaUnavailable(Exception):
    """RDMA cannot be used here; the message says why (for the one log line of the fallback)."""


class RdmaError(Exception):
    """A verbs operation failed (a completion with an error status, a QP in error)."""

    def __init__(self, message: str, status: str = "error") -> None:
        super().__init__(message)
        self.status = status


def buffer_address(view: memoryview) -> int:
    """The address of a writable buffer's first byte (for registration and SGEs)."""
    holder = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder


def _event_fds() -> set[int]:
    """This process's open RDMA event descriptors (completion channels and the like)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "infiniband" in os.readlink(f"/proc/self/fd/{name}"):
                found.add(int(name))
        except OSError:  # the descriptor listdir itself used, already closed
            continue
    return found


def _roce_v2_gid(device: str, port: int) -> int | None:
    """The GID index of the port's RoCE v2 IPv4 address (InfiniBand ports: 0)."""
    port_dir = SYSFS / device / "ports" / str(port)
    if (port_dir / "link_layer").read_text().strip() == "InfiniBand":
        return 0
    types = port_dir / "gid_attrs" / "types"
    candidates = []
    for entry in sorted(types.iterdir(), key=lambda p: int(p.name)) if types.is_dir() else []:
        try:
            kind = entry.read_text().strip()
            gid = (port_dir / "gids" / entry.name).read_text().strip()
        except OSError:  # unused entries cannot be read
            continue
        if kind == "RoCE v2" and gid != "0000:0000:0000:0000:0000:0000:0000:0000":
            candidates.append((not gid.startswith("0000:0000:0000:0000:0000:ffff:"), int(entry.name)))
    return min(candidates)[1] if candidates else None


@dataclass
class Endpoint:
    """What a peer needs to connect a queue pair to ours (sent over the TCP control channel)."""

    qp_num: int
    psn: int
    gid: str


@dataclass
class Window:
    """A memory window granted to one peer: its rkey reads exactly [address, address+length)."""

    mw: Any
    rkey: int
    address: int
    length: int

    def close(self) -> None:
        try:
            self.mw.close()
        except Exception as error:
            log.debug("deallocating a memory window: %s", error)


@dataclass
class MemoryRegion:
    mr: Any
    address: int
    length: int

    @property
    def lkey(self) -> int:
        return int(self.mr.lkey)

    @property
    def rkey(self) -> int:
        return int(self.mr.rkey)

    def close(self) -> None:
        self.mr.close()


class RdmaDevice:
    """One opened RDMA port: protection domain, completion channel and queue, dispatch."""

    def __init__(self, name: str, port: int, gid_index: int) -> None:
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.device import Context
        from pyverbs.pd import PD

        self.name, self.port, self.gid_index = name, port, gid_index
        self.context = Context(name=name)
        self.gid = str(self.context.query_gid(port, gid_index))
        self.pd = PD(self.context)
        # pyverbs does not expose the channel's fd: it is the one descriptor the channel opened.
        before = _event_fds()
        self.channel = CompChannel(self.context)
        opened = _event_fds() - before
        if len(opened) != 1:
            raise RdmaUnavailable(f"{name}: cannot find the completion channel's file descriptor ({opened})")
        self.channel_fd = opened.pop()
        flags = fcntl.fcntl(self.channel_fd, fcntl.F_GETFL)
        fcntl.fcntl(self.channel_fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        self.cq = CQ(self.context, CQ_ENTRIES, None, self.channel, 0)
        self.cq.req_notify()
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[trio.Event, list[Any]]] = {}
        self.closed = False

    def describe(self) -> str:
        return f"{self.name} port {self.port} GID {self.gid} (index {self.gid_index})"

    # Memory ---------------------------------------------------------------------------

    def register(self, view: memoryview, remote_read: bool = False, windows: bool = False) -> MemoryRegion:
        """Registers a buffer for READs into it (local write), for peers to READ from it
        (remote read: anyone with the rkey reads all of it) or for memory windows (peers READ
        only the windows granted to them)."""
        import pyverbs.enums as e

        access = (e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_READ if remote_read else 0)
                  | (e.IBV_ACCESS_MW_BIND if windows else 0))
        from pyverbs.mr import MR

        address = buffer_address(view)
        return MemoryRegion(MR(self.pd, len(view), access, address=address), address, len(view))

    # Queue pairs ----------------------------------------------------------------------

    def create_queue_pair(self) -> QueuePair:
        return QueuePair(self)

    # Completions ----------------------------------------------------------------------

    async def run_completions(self) -> None:
        """Delivers completions to the tasks waiting for them (a background task)."""
        while not self.closed:
            await trio.lowlevel.wait_readable(self.channel_fd)
            try:
                self.channel.get_cq_event(self.cq)
            except Exception:  # EAGAIN: woken without an event
                continue
            self.cq.ack_events(1)
            self.cq.req_notify()  # before draining: a completion after the drain raises a new event
            self._drain()

    def _drain(self) -> None:
        import pyverbs.enums as e

        while True:
            count, completions = self.cq.poll(32)
            for wc in completions:
                waiter = self._waiting.pop(wc.wr_id, None)
                if waiter is None:
                    continue
                event, result = waiter
                result.append(None if wc.status == e.IBV_WC_SUCCESS else _status_name(wc.status))
                event.set()
            if count < 32:
                return

    async def _post_and_wait(self, qp: QueuePair, wr: Any, wr_id: int, what: str) -> None:
        """Posts a signaled work request and waits for its completion; RdmaError on failure."""
        if qp.broken:
            raise RdmaError(f"{what}: queue pair {qp.qp_num} is in error", "qp_error")
        event, result = trio.Event(), []
        self._waiting[wr_id] = (event, result)
        try:
            qp.qp.post_send(wr)
        except Exception as error:
            self._waiting.pop(wr_id, None)
            qp.broken = True
            raise RdmaError(f"{what}: posting failed: {error}", "post_failed") from None
        with trio.move_on_after(READ_TIMEOUT_S):
            await event.wait()
        if not event.is_set():
            self._waiting.pop(wr_id, None)
            qp.broken = True  # an unanswered request may still complete later: never reuse this QP
            raise RdmaError(f"{what}: not completed within {READ_TIMEOUT_S:.0f} s", "timeout")
        if result[0] is not None:
            qp.broken = True  # any error completion moves an RC QP to the error state
            raise RdmaError(f"{what} failed: {result[0]}", result[0])

    async def read(self, qp: QueuePair, local: MemoryRegion, local_address: int, length: int,
                   remote_address: int, rkey: int) -> None:
        """One RDMA READ of `length` bytes into registered memory; RdmaError on failure."""
        from pyverbs.wr import SGE, SendWR
        import pyverbs.enums as e

        wr_id = next(self._ids)
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(local_address, length, local.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, remote_address)
        await self._post_and_wait(qp, wr, wr_id, f"READ of {length} bytes")

    async def grant(self, qp: QueuePair, region: MemoryRegion, address: int, length: int) -> Window:
        """Lets the peer of `qp` (and only it) READ [address, address+length) of `region`: a
        type 2 memory window bound on that queue pair, with a fresh rkey."""
        from pyverbs.mr import MW, MWBindInfo
        from pyverbs.wr import SendWR
        import pyverbs.enums as e

        window = MW(self.pd, e.IBV_MW_TYPE_2)
        wr_id = next(self._ids)
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_BIND_MW, send_flags=e.IBV_SEND_SIGNALED)
        wr.set_bind_wr(window, MWBindInfo(region.mr, address, length, e.IBV_ACCESS_REMOTE_READ))
        try:
            await self._post_and_wait(qp, wr, wr_id, f"binding a window of {length} bytes")
        except BaseException:
            window.close()
            raise
        return Window(window, int(wr.rkey), address, length)

    async def revoke(self, qp: QueuePair, window: Window) -> bool:
        """Invalidates a granted window (a READ with its rkey fails from then on), then frees
        it; False if the queue pair is in error (no READ passes through it any more).

        The order matters on soft-RoCE: freeing a window still bound to a working queue
        pair, or destroying an errored queue pair that a window is still bound to, stalls
        the process for ~50 s; invalidating first, or freeing the window of an errored
        pair before the pair, does not."""
        from pyverbs.wr import SendWR
        import pyverbs.enums as e

        try:
            if qp.broken:
                return False
            wr_id = next(self._ids)
            wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_LOCAL_INV, send_flags=e.IBV_SEND_SIGNALED)
            wr.imm_data = window.rkey  # the union member invalidate_rkey
            try:
                await self._post_and_wait(qp, wr, wr_id, f"invalidating rkey {window.rkey:#x}")
            except RdmaError as error:
                log.debug("rdma: %s", error)
                return False
            return True
        finally:
            window.close()

    def close(self) -> None:
        self.closed = True
        for event, result in self._waiting.values():
            result.append("closed")
            event.set()
        self._waiting.clear()
        try:  # the context closes its queue pairs, windows, regions, queues and domain in order
            self.context.close()
        except Exception as error:  # teardown goes on: the process may be exiting
            log.warning("closing RDMA device %s: %s", self.name, error)


class QueuePair:
    """A reliable-connected queue pair to one peer, for READs (ours) or being READ (theirs)."""

    def __init__(self, device: RdmaDevice) -> None:
        from pyverbs.qp import QP, QPCap, QPInitAttr
        import pyverbs.enums as e

        self.device = device
        cap = QPCap(max_send_wr=MAX_READS_IN_FLIGHT, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(device.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=device.cq, rcq=device.cq, cap=cap))
        self.qp_num = int(self.qp.qp_num)
        self.psn = random.getrandbits(24)
        self.broken = False

    def endpoint(self) -> Endpoint:
        return Endpoint(self.qp_num, self.psn, self.device.gid)

    def connect(self, remote: Endpoint) -> None:
        """INIT → RTR → RTS towards the peer's queue pair."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr
        import pyverbs.enums as e

        device = self.device
        attr = QPAttr(port_num=device.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_MW_BIND
        attr.path_mtu = e.IBV_MTU_1024
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14  # 4.096 µs × 2^14 ≈ 67 ms per retry
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        route = GlobalRoute(dgid=GID(remote.gid), sgid_index=device.gid_index)
        attr.ah_attr = AHAttr(port_num=device.port, is_global=1, gr=route)
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.sq_psn = self.psn
        self.qp.to_rts(attr)

    def close(self) -> None:
        try:
            self.qp.close()
        except Exception as error:
            log.debug("closing queue pair %d: %s", self.qp_num, error)


# ibv_wc_status, in enum order (a stable ABI); pyverbs' enums mix them with opcode names.
WC_STATUSES = ("success", "loc_len_err", "loc_qp_op_err", "loc_eec_op_err", "loc_prot_err", "wr_flush_err",
               "mw_bind_err", "bad_resp_err", "loc_access_err", "rem_inv_req_err", "rem_access_err", "rem_op_err",
               "retry_exc_err", "rnr_retry_exc_err", "loc_rdd_viol_err", "rem_inv_rd_req_err", "rem_abort_err",
               "inv_eecn_err", "inv_eec_state_err", "fatal_err", "resp_timeout_err", "general_err", "tm_err",
               "tm_rndv_incomplete")


def _status_name(status: int) -> str:
    return WC_STATUSES[status] if 0 <= status < len(WC_STATUSES) else f"status_{status}"


def probe(device_name: str | None = None) -> RdmaDevice:
    """Opens the first active RDMA port (RoCE v2 or InfiniBand), or raises RdmaUnavailable
    with the reason."""
    try:
        from pyverbs.device import get_device_list
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as error:
        raise RdmaUnavailable(f"pyverbs is not importable ({error}); on Debian: apt install python3-pyverbs "
                              "and a virtual environment made with --system-site-packages") from None
    try:
        devices = [d.name.decode() for d in get_device_list()]
    except PyverbsError as error:
        raise RdmaUnavailable(f"no RDMA devices ({error})") from None
    if device_name is not None:
        devices = [d for d in devices if d == device_name]
    if not devices:
        raise RdmaUnavailable("no RDMA devices" + (f" named {device_name}" if device_name else ""))
    reasons = []
    for name in devices:
        ports = sorted(int(p.name) for p in (SYSFS / name / "ports").iterdir()) if (SYSFS / name).is_dir() else [1]
        for port in ports:
            state = (SYSFS / name / "ports" / str(port) / "state").read_text().strip() if (SYSFS / name).is_dir() else ""
            if "ACTIVE" not in state:
                reasons.append(f"{name} port {port} is {state or 'not active'}")
                continue
            gid_index = _roce_v2_gid(name, port)
            if gid_index is None:
                reasons.append(f"{name} port {port} has no RoCE v2 address")
                continue
            try:
                return RdmaDevice(name, port, gid_index)
            except Exception as error:
                reasons.append(f"{name} port {port}: {error}")
    raise RdmaUnavailable("; ".join(reasons))

"""Inside the VM: the verbs layer alone — READs between two queue pairs, a wrong rkey refused,
memory windows that grant exactly one range and stop working once revoked."""

import mmap
import sys

import trio

from kvfs.net.verbs import RdmaError, buffer_address, probe


async def expect_refused(read) -> str:
    try:
        await read
    except RdmaError as error:
        return error.status
    raise AssertionError("a READ that should be refused succeeded")


async def main() -> None:
    device = probe()
    print("device:", device.describe())
    remote_map, local_map = mmap.mmap(-1, 1 << 20), mmap.mmap(-1, 1 << 20)
    remote_map[:11] = b"hello rdma!"
    remote_map[65536:65536 + 5] = b"later"
    remote_view, local_view = memoryview(remote_map), memoryview(local_map)
    exposed = device.register(remote_view, remote_read=True)
    windowed = device.register(remote_view, windows=True)
    landing = device.register(local_view)

    def pair():
        reader, owner = device.create_queue_pair(), device.create_queue_pair()
        reader.connect(owner.endpoint())
        owner.connect(reader.endpoint())
        return reader, owner

    pairs = [pair() for _ in range(4)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(device.run_completions)
        reader, owner = pairs.pop()
        local = buffer_address(local_view)
        await device.read(reader, landing, local, 11, exposed.address, exposed.rkey)
        assert bytes(local_map[:11]) == b"hello rdma!", bytes(local_map[:11])
        async with trio.open_nursery() as reads:  # several in flight
            for i in range(8):
                reads.start_soon(device.read, reader, landing, local + 4096 * (i + 1), 5,
                                 exposed.address + 65536, exposed.rkey)
        assert all(bytes(local_map[4096 * (i + 1):4096 * (i + 1) + 5]) == b"later" for i in range(8))
        print("wrong rkey:", await expect_refused(device.read(reader, landing, local, 11, exposed.address,
                                                               exposed.rkey + 7)))

        # A window grants one range to one queue pair; the MR's own rkey grants nothing remotely.
        reader, owner = pairs.pop()
        window = await device.grant(owner, windowed, windowed.address + 65536, 4096)
        local_map[:5] = b"....."
        await device.read(reader, landing, local, 5, windowed.address + 65536, window.rkey)
        assert bytes(local_map[:5]) == b"later"
        try:  # real NICs refuse it; rxe before Linux 6.x checks the region's range, not the window's
            await device.read(reader, landing, local, 11, windowed.address, window.rkey)
            print("outside the window: allowed by this rxe")
        except RdmaError as error:
            print("outside the window:", error.status)
        # Always invalidated before it is deallocated: on rxe, deallocating a bound window
        # stalls for ~50 s.
        await device.revoke(owner, window)
        reader, owner = pairs.pop()
        window = await device.grant(owner, windowed, windowed.address, 4096)
        await device.read(reader, landing, local, 11, windowed.address, window.rkey)
        assert bytes(local_map[:11]) == b"hello rdma!"
        await device.revoke(owner, window)
        print("revoked window:", await expect_refused(
            device.read(reader, landing, local, 11, windowed.address, window.rkey)))
        reader, owner = pairs.pop()
        print("the region's own rkey:", await expect_refused(
            device.read(reader, landing, local, 11, windowed.address, windowed.rkey)))
        nursery.cancel_scope.cancel()
    device.close()
    print("SMOKE OK")


if __name__ == "__main__":
    trio.run(main)
    sys.exit(0)

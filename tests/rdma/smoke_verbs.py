"""Inside the VM: the verbs layer alone — READs between two queue pairs, a wrong rkey refused."""

import mmap
import sys

import trio

from kvfs.cluster.verbs import RdmaError, buffer_address, probe


async def main() -> None:
    device = probe()
    print("device:", device.describe())
    remote_map, local_map = mmap.mmap(-1, 1 << 20), mmap.mmap(-1, 1 << 20)
    remote_map[:11] = b"hello rdma!"
    remote_map[65536:65536 + 5] = b"later"
    remote_view, local_view = memoryview(remote_map), memoryview(local_map)
    exposed = device.register(remote_view, remote_read=True)
    landing = device.register(local_view, remote_read=False)
    reader, owner = device.create_queue_pair(), device.create_queue_pair()
    reader.connect(owner.endpoint())
    owner.connect(reader.endpoint())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(device.run_completions)
        await device.read(reader, landing, buffer_address(local_view), 11, exposed.address, exposed.rkey)
        assert bytes(local_map[:11]) == b"hello rdma!", bytes(local_map[:11])
        async with trio.open_nursery() as reads:  # several in flight
            for i in range(8):
                reads.start_soon(device.read, reader, landing, buffer_address(local_view[4096 * (i + 1):]), 5,
                                 exposed.address + 65536, exposed.rkey)
        assert all(bytes(local_map[4096 * (i + 1):4096 * (i + 1) + 5]) == b"later" for i in range(8))
        try:
            await device.read(reader, landing, buffer_address(local_view), 11, exposed.address, exposed.rkey + 7)
        except RdmaError as error:
            print("wrong rkey:", error.status)
            assert error.status == "rem_access_err", error.status
        else:
            raise AssertionError("a READ with a wrong rkey succeeded")
        nursery.cancel_scope.cancel()
    print("SMOKE OK")


trio.run(main)
sys.exit(0)

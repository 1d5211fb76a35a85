"""The SSD tier: an io_uring I/O engine, segment files, an lmdb index, offload and recovery."""

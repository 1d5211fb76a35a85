"""A node's DRAM tier: one preallocated arena, a buddy allocator, chunk storage."""

"""The POSIX adapter: translates FUSE requests into calls on a `kvfs.node.service.Node`."""

"""The network: the only code with sockets or RDMA verbs.

Frames on a connection (streams, over TLS) and the setup that opens every one, the master's server
and its pipelined client, a node's link to the master, the peer chunk transports (TCP and
RDMA) and the verbs beneath them. What travels is defined in kvfs.wire.
"""

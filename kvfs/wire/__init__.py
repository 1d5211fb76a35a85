"""The wire, sans-I/O: frames, the handshake's proofs and the message structs.

Nothing here touches a socket or an event loop; the connections in kvfs.net feed bytes in
and take bytes out.
"""

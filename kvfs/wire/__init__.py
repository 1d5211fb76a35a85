"""The wire, sans-I/O: frames, the connection setup's welcome and the message structs.

Nothing here touches a socket or an event loop; the connections in kvfs.net feed bytes in
and take bytes out.
"""

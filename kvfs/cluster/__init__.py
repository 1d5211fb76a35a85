"""Metadata: the namespace and the object directory, served by the master.

In single-node mode the master runs embedded in the node process; the request and
response messages in `kvfs.wire.messages` are the same ones a networked master will carry.
"""

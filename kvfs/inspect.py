"""`kvfs inspect PATH`: one file's facts, from its `user.kvfs.info` attribute."""

from __future__ import annotations

import errno
import json
import os
import time

from kvfs.config import format_size
from kvfs.errors import KvfsError


def file_facts(path: str) -> dict:
    try:
        return json.loads(os.getxattr(path, "user.kvfs.info"))
    except OSError as error:
        if error.errno in (errno.ENODATA, errno.ENOTSUP):
            raise KvfsError(error.errno, f"{path}: not a file in a kvfs mount") from None
        raise KvfsError(error.errno or errno.EIO, f"{path}: {error.strerror}") from None


def _when(ns: int) -> str:
    if not ns:
        return "never"
    ago = time.time() - ns / 1e9
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ns / 1e9))} ({ago:.0f} s ago)"


def render_facts(path: str, facts: dict) -> str:
    where = "this node" if facts["stored_here"] else \
        f"node {facts['node']} {facts['node_name']} at {facts['node_address']} ({'up' if facts['node_up'] else 'down'})"
    lines = [
        f"{path}",
        f"  size         {facts['size']} bytes ({format_size(facts['size'])}), "
        f"{len(facts['chunks'])} chunk(s) of up to {format_size(facts['chunk_size'])}",
        f"  version      {facts['version']} ({'sealed' if facts['sealed'] else 'being written'})",
        f"  stored on    {where}",
        f"  tier         {facts['tier']}; copy on SSD: {'yes' if facts['on_ssd'] else 'no'}",
        f"  use          {facts['hits']} opens, last {_when(facts['last_access_ns'])}",
        f"  leases       {facts['readers']} reader(s), {facts['writers']} writer(s) open",
    ]
    if facts["ssd_extents"]:
        lines.append(f"  ssd extents  {facts['ssd_extents']}")
    lines.append(f"  {'CHUNK':>5} {'OFFSET':>12} {'LENGTH':>10}  CHECKSUM")
    for chunk in facts["chunks"]:
        lines.append(f"  {chunk['index']:>5} {chunk['offset']:>12} {chunk['length']:>10}  {chunk['checksum'] or '-'}")
    return "\n".join(lines)

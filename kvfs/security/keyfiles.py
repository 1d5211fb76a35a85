"""Private key files: readable by their owner only, or refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvfs.errors import ConfigError


def check_private_file(path: Path) -> None:
    """A key readable by anyone but its owner is refused, with the command that fixes it."""
    try:
        st = os.stat(path)
    except OSError as error:
        raise ConfigError(f"{path}: {error.strerror}") from None
    if st.st_mode & 0o077:
        raise ConfigError(f"{path}: mode {stat.S_IMODE(st.st_mode):04o} is wider than 0600; a private key "
                          f"must be readable by its owner only (chmod 600 {path})")

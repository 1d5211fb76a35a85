"""Random operation sequences on a kvfs mount and on tmpfs must give the same results."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from conftest import drop_page_cache
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

CHECKED_TREES: list[int] = []  # sizes of the trees compared, to prove the machine ran
NAMES = st.sampled_from(["a", "b", "c.tmp", "d/a", "d/b", "e/d/x"])
DIRS = st.sampled_from(["d", "e", "e/d"])
DATA = st.one_of(st.binary(max_size=64), st.builds(lambda n, b: bytes([b]) * n,
                                                  st.integers(0, 5 << 20), st.integers(0, 255)))


def outcome(function, *args):
    """('ok', value) or ('error', errno): what a POSIX caller observes."""
    try:
        return "ok", function(*args)
    except OSError as error:
        return "error", error.errno


def snapshot(root: Path) -> dict[str, bytes | None]:
    tree: dict[str, bytes | None] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs:
            tree[os.path.relpath(os.path.join(directory, name), root)] = None
        for name in files:
            path = os.path.join(directory, name)
            tree[os.path.relpath(path, root)] = Path(path).read_bytes()
    return tree


@pytest.fixture(scope="module")
def tmpfs_root() -> Path:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    root = base / f"kvfs-diff-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module", params=["dram", "ssd"])
def mount_under_test(request, shared_mount, tmp_path_factory):
    """The shared DRAM-only mount, and a mount with a small DRAM tier over an SSD tier
    (every write then goes through offload, demotion, SSD reads and promotion)."""
    if request.param == "dram":
        yield shared_mount
        return
    from conftest import _mount

    root = tmp_path_factory.mktemp("kvfs-ssd")
    yield from _mount(root, "32M", "--disk", str(root / "disk"), "--disk-size", "256M")


def test_kvfs_behaves_like_tmpfs(mount_under_test, tmpfs_root: Path) -> None:
    shared_mount = mount_under_test
    class Differential(RuleBasedStateMachine):
        @initialize()
        def fresh_roots(self) -> None:
            run = uuid.uuid4().hex[:8]
            self.roots = [shared_mount.path / f"diff-{run}", tmpfs_root / run]
            for root in self.roots:
                root.mkdir()

        def both(self, function, *relative, **extra):
            results = [outcome(function, *[root / r for r in relative], **extra) for root in self.roots]
            assert results[0] == results[1], f"{function.__name__}{relative}: kvfs {results[0]}, tmpfs {results[1]}"

        @rule(directory=DIRS)
        def mkdir(self, directory: str) -> None:
            self.both(os.mkdir, directory)

        @rule(directory=DIRS)
        def rmdir(self, directory: str) -> None:
            self.both(os.rmdir, directory)

        @rule(name=NAMES, data=DATA)
        def store(self, name: str, data: bytes) -> None:
            self.both(lambda path: path.write_bytes(data), name)

        @rule(name=NAMES, data=st.binary(min_size=1, max_size=32), offset=st.integers(0, 6 << 20))
        def pwrite(self, name: str, data: bytes, offset: int) -> None:
            def write_at(path: Path) -> int:
                fd = os.open(path, os.O_WRONLY)
                try:
                    return os.pwrite(fd, data, offset)
                finally:
                    os.close(fd)
            self.both(write_at, name)

        @rule(name=NAMES, size=st.integers(0, 6 << 20))
        def truncate(self, name: str, size: int) -> None:
            self.both(lambda path: os.truncate(path, size), name)

        @rule(source=NAMES | DIRS, destination=NAMES | DIRS)
        def rename(self, source: str, destination: str) -> None:
            self.both(os.rename, source, destination)

        @rule(name=NAMES)
        def unlink(self, name: str) -> None:
            self.both(os.unlink, name)

        @rule(name=NAMES | DIRS)
        def read(self, name: str) -> None:
            self.both(lambda path: path.read_bytes(), name)

        @rule(name=NAMES | DIRS)
        def size(self, name: str) -> None:
            self.both(lambda path: path.stat().st_size if path.is_file() else None, name)

        @rule()
        def drop_caches(self) -> None:
            """Sends later reads to the daemon, and (with an SSD tier) to the SSD."""
            os.setxattr(shared_mount.path, "user.kvfs.control", b"sync")
            os.setxattr(shared_mount.path, "user.kvfs.control", b"drop-dram")
            drop_page_cache()

        @invariant()
        def same_tree(self) -> None:
            trees = [snapshot(root) for root in self.roots]
            assert trees[0] == trees[1]
            CHECKED_TREES.append(len(trees[0]))

    Differential.TestCase.settings = settings(
        max_examples=int(os.environ.get("KVFS_DIFF_EXAMPLES", "40")), stateful_step_count=25, deadline=None,
        derandomize=bool(os.environ.get("CI")),  # CI replays a fixed set; runs elsewhere explore
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    Differential.TestCase().runTest()
    assert len(CHECKED_TREES) >= 40 and max(CHECKED_TREES) >= 3

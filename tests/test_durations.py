"""Every option that is a duration takes a finite number of seconds, 0 or more (the gc
interval: above 0), from the command line, the configuration file and the environment alike.
NaN, infinity or a negative number once started a daemon whose bounds were none: a
`--temp-grace nan` mount failed its orphan collection with a traceback every interval, and
one with `--backpressure-timeout -3` started too, its writers' wait over before it began."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import find_mount

REFUSED = [("--temp-grace", "nan"), ("--backpressure-timeout", "-3"), ("--entry-timeout", "inf"),
           ("--negative-timeout", "-inf"), ("--publish-grace", "NaN"), ("--start-timeout", "-1"),
           ("--gc-interval", "0"), ("--gc-interval", "nan")]


def kvfs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfs", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVFS_CONFIG": "/dev/null", **(env or {})})


@pytest.mark.parametrize("option,value", REFUSED)
def test_a_duration_that_is_no_bound_is_refused_on_the_command_line(tmp_path: Path, option: str, value: str) -> None:
    (tmp_path / "mnt").mkdir()
    result = kvfs("mount", str(tmp_path / "mnt"), "--foreground", "--dram", "64M", "--no-metrics", f"{option}={value}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert option in lines[-1] and value in lines[-1], lines
    assert "Traceback" not in result.stderr
    assert find_mount(str(tmp_path / "mnt")) is None


@pytest.mark.parametrize("command,option", [("node", "--master-wait"), ("master", "--dead-after"),
                                            ("master", "--forget-dead-after"), ("master", "--temp-grace")])
def test_the_cluster_daemons_refuse_them_too(tmp_path: Path, command: str, option: str) -> None:
    args = (["node", "--master", "127.0.0.1:1", "--mount", str(tmp_path)] if command == "node"
            else ["master", "--data", str(tmp_path / "data")])
    result = kvfs(*args, option, "nan")
    assert result.returncode == 2 and option in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_the_configuration_file_and_the_environment_are_checked_alike(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    config = tmp_path / "kvfs.toml"
    config.write_text("[mount]\nbackpressure_timeout = nan\n")  # a valid TOML float
    from_file = kvfs("mount", str(tmp_path / "mnt"), "--foreground", "--dram", "64M", "--no-metrics",
                     env={"KVFS_CONFIG": str(config)})
    assert from_file.returncode != 0 and "backpressure_timeout" in from_file.stderr, from_file.stderr
    assert "not a number of seconds" in from_file.stderr and "Traceback" not in from_file.stderr
    from_env = kvfs("mount", str(tmp_path / "mnt"), "--foreground", "--dram", "64M", "--no-metrics",
                    env={"KVFS_GC_INTERVAL": "0"})
    assert from_env.returncode != 0 and "KVFS_GC_INTERVAL" in from_env.stderr, from_env.stderr
    assert find_mount(str(tmp_path / "mnt")) is None


def test_durations_in_range_still_start_a_mount(make_mount) -> None:
    mount = make_mount("64M", "--temp-grace", "0", "--publish-grace", "0.5", "--gc-interval", "0.2",
                       "--backpressure-timeout", "0", "--negative-timeout", "0", "--entry-timeout", "86400")
    (mount.path / "a.bin").write_bytes(b"a" * 4096)
    assert (mount.path / "a.bin").read_bytes() == b"a" * 4096

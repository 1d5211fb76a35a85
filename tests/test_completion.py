"""Bash completion: generated from the parser, run by a real bash."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvfs.cli import build_parser


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    result = subprocess.run([sys.executable, "-m", "kvfs", "completion", "bash"], capture_output=True, text=True,
                            timeout=60, check=True)
    path = tmp_path_factory.mktemp("completion") / "kvfs"
    path.write_text(result.stdout)
    return path


def complete(script: Path, line: str, cwd: Path | None = None) -> list[str]:
    """What bash offers for the last word of `line` (an empty last word: a fresh one)."""
    words = line.split(" ")
    program = (f"source {shlex.quote(str(script))}; COMP_WORDS=({' '.join(shlex.quote(w) for w in words)}); "
               f"COMP_CWORD={len(words) - 1}; _kvfs; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
    result = subprocess.run(["bash", "--norc", "-c", program], capture_output=True, text=True, timeout=30,
                            cwd=cwd, check=True)
    assert result.stderr == ""
    return sorted(filter(None, result.stdout.split("\n")))


def test_commands_options_and_choices(script: Path) -> None:
    assert complete(script, "kvfs m") == ["master", "mount"]
    assert complete(script, "kvfs d") == ["du"]
    assert complete(script, "kvfs mount /mnt/kvfs --disk-") == ["--disk-fit", "--disk-size"]
    assert complete(script, "kvfs mount /mnt/kvfs --io-engine ") == ["auto", "io_uring", "threads"]
    assert complete(script, "kvfs node --transport r") == ["rdma"]
    assert complete(script, "kvfs mount --dram ") == []  # a size: nothing to offer
    assert complete(script, "kvfs completion ") == ["bash"]


def test_paths_where_the_parser_takes_paths(script: Path, tmp_path: Path) -> None:
    (tmp_path / "nvme").mkdir()
    (tmp_path / "notes.toml").write_text("")
    assert complete(script, "kvfs mount /mnt/kvfs --disk n", cwd=tmp_path) == ["nvme"]  # directories only
    assert complete(script, "kvfs mount /mnt/kvfs --config no", cwd=tmp_path) == ["notes.toml"]
    assert complete(script, "kvfs umount ", cwd=tmp_path) == ["nvme"]


def test_every_command_and_option_of_the_parser_is_offered(script: Path) -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert complete(script, "kvfs ") == sorted([*commands, "-h", "--help", "--version"])
    for name, subparser in commands.items():
        options = sorted(option for action in subparser._actions for option in action.option_strings)
        assert complete(script, f"kvfs {name} -") == options, name

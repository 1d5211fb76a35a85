"""Where settings come from, weakest first: built-in defaults, the TOML file, `KVFS_*`
environment variables, command-line flags.

The TOML file (`/etc/kvfs/kvfs.toml` unless `--config` or `KVFS_CONFIG` names
another) has a table per command (`[mount]`, `[node]`, `[master]`, `[status]`)
whose keys are the command's long options (`dram = "16G"`, `metrics-listen` or
`metrics_listen`). The variable of an option is `KVFS_` and its name in capitals
(`KVFS_DRAM=16G`, `KVFS_METRICS_LISTEN=127.0.0.1:0`). Every value is checked
like a flag would be, and an error names the file or variable and the setting.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from typing import Any, Mapping

from kvfs.errors import ConfigError

DEFAULT_CONFIG_FILE = "/etc/kvfs/kvfs.toml"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
# Not settings: the file itself, and the help and version flags.
_NOT_SETTINGS = {"config", "help", "version"}


def _config_path(argv: list[str], environ: Mapping[str, str]) -> tuple[str, bool]:
    """The config file and whether it was asked for (a missing default file is fine)."""
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            return argv[index + 1], True
        if arg.startswith("--config="):
            return arg.split("=", 1)[1], True
    if environ.get("KVFS_CONFIG"):
        return environ["KVFS_CONFIG"], True
    return DEFAULT_CONFIG_FILE, False


def _is_flag(action: argparse.Action) -> bool:
    return action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction)


def _coerce(action: argparse.Action, value: Any, where: str) -> Any:
    """A value from the file or environment, checked and converted as its flag's would be."""
    if _is_flag(action):
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            value = value.strip().lower() in _TRUE
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} is not true or false")
        # store_false flags (--no-metrics) keep the positive meaning of their dest (metrics = false).
        return value
    if isinstance(value, (dict, list)) or isinstance(value, bool):
        raise ConfigError(f"{where}: {value!r} is not a single value")
    if action.type is not None:
        try:
            value = action.type(str(value))  # type: ignore[misc]
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{where}: {value!r} is not valid ({error})") from None
    else:
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(sorted(map(str, action.choices)))}")
    return value


def _settings(subparser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The command's options by their names as the file and the environment spell them."""
    found = {}
    for action in subparser._actions:
        if not action.option_strings or action.dest in _NOT_SETTINGS:
            continue
        long_names = [name[2:] for name in action.option_strings if name.startswith("--")]
        positive = [name for name in long_names if not name.startswith("no-")] or [action.dest.replace("_", "-")]
        for name in positive + [action.dest.replace("_", "-")]:
            found[name.replace("_", "-")] = action
    return found


def _load_table(path: str, command: str, required: bool) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except FileNotFoundError:
        if required:
            raise ConfigError(f"config file {path}: does not exist") from None
        return {}
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"config file {path}: {error}") from None
    table = document.get(command, {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: [{command}] is not a table")
    return table


def parse_with_sources(parser: argparse.ArgumentParser, argv: list[str],
                       environ: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """Parses argv with the file's table and the environment as defaults (flags still win)."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    subparsers = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    if command not in subparsers:
        return parser.parse_args(argv)
    subparser = subparsers[command]
    settings = _settings(subparser)
    path, required = _config_path(argv, environ)
    defaults: dict[str, Any] = {}
    for key, value in _load_table(path, command, required).items():
        action = settings.get(str(key).replace("_", "-"))
        if action is None:
            raise ConfigError(f"{path}: [{command}] has no setting {key!r}")
        defaults[action.dest] = _coerce(action, value, f"{path}: [{command}] {key}")
    for name, action in settings.items():
        variable = "KVFS_" + name.replace("-", "_").upper()
        if variable in environ:
            defaults[action.dest] = _coerce(action, environ[variable], variable)
    subparser.set_defaults(**defaults)
    for action in subparser._actions:  # a required option set in the file or environment no longer is
        if action.dest in defaults:
            action.required = False
    return parser.parse_args(argv)

"""Bash completion generated from the command's argparse tree, so that it always offers the
subcommands, options and choices the parser has (`kvfs completion bash`)."""

from __future__ import annotations

import argparse
import shlex

# Options and positionals whose values are paths (the rest take values there is nothing to offer for).
DIRECTORIES = {"disk", "data", "mountpoint", "tls_dir", "dir", "ca_dir", "out"}
FILES = {"config", "log_file", "path"}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _value_completion(action: argparse.Action) -> str:
    """The bash that fills COMPREPLY with candidates for this action's value."""
    if action.choices is not None:
        words = " ".join(shlex.quote(str(choice)) for choice in action.choices)
        return f'COMPREPLY=($(compgen -W {shlex.quote(words)} -- "$cur"))'
    if action.dest in DIRECTORIES:
        return 'COMPREPLY=($(compgen -d -- "$cur"))'
    if action.dest in FILES:
        return 'COMPREPLY=($(compgen -f -- "$cur"))'
    return "COMPREPLY=()"


def _command_case(name: str, parser: argparse.ArgumentParser) -> list[str]:
    options = [option for action in parser._actions for option in action.option_strings]
    valued = [action for action in parser._actions if action.option_strings and action.nargs != 0]
    positionals = [action for action in parser._actions if not action.option_strings]
    lines = [f"        {shlex.quote(name)})", '            case $prev in']
    for action in valued:
        lines.append(f"                {'|'.join(action.option_strings)}) {_value_completion(action)}; return ;;")
    lines.append("            esac")
    words = shlex.quote(" ".join(options))
    positional = _value_completion(positionals[0]) if positionals else "COMPREPLY=()"
    lines += ['            if [[ $cur == -* ]]; then',
              f'                COMPREPLY=($(compgen -W {words} -- "$cur"))',
              "            else",
              f"                {positional}",
              "            fi",
              "            ;;"]
    return lines


def bash_completion(parser: argparse.ArgumentParser) -> str:
    commands = _subcommands(parser)
    top = [option for action in parser._actions for option in action.option_strings]
    prog = parser.prog
    function = f"_{prog.replace('-', '_')}"
    lines = [f"# bash completion for {prog}, generated from its parser by `{prog} completion bash`",
             f"{function}() {{",
             '    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} command="" i',
             "    for ((i = 1; i < COMP_CWORD; i++)); do",
             '        if [[ ${COMP_WORDS[i]} != -* ]]; then command=${COMP_WORDS[i]}; break; fi',
             "    done",
             "    case $command in",
             '        "")',
             f'            COMPREPLY=($(compgen -W {shlex.quote(" ".join([*commands, *top]))} -- "$cur"))',
             "            ;;"]
    for name, subparser in commands.items():
        lines += _command_case(name, subparser)
    lines += ["    esac", "}", f"complete -o filenames -F {function} {prog}", ""]
    return "\n".join(lines)

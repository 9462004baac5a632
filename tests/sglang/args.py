"""``ServerArgs`` for the SGLang tests, made by SGLang's own command line (its parser and
``ServerArgs.from_cli_args``, as ``prepare_server_args`` makes them for ``python -m
sglang.launch_server``): a flag SGLang's parser refuses fails the test that uses it, where building
``ServerArgs(**kwargs)`` would skip the parser's checks.

Two exceptions, values only Python can give, are set on the parsed object instead:
hiradix's own storage names (``memory``, ``peer``, ``sglang:NAME``), which are not among
the parser's fixed ``--hicache-storage-backend`` choices (docs/sglang/options.md documents them as working
only where ``ServerArgs`` is built in Python), and a fractional ``--hicache-size`` (whole
GB on the command line; the tests size host pools in kilobytes).
"""

from __future__ import annotations

import argparse
from typing import Any


class ParserRefused(ValueError):
    """SGLang's command line refused the arguments (argparse's message)."""


def _storage_choices() -> tuple[str, ...]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:  # argparse keeps no public index of its options
        if action.dest == "hicache_storage_backend":
            return tuple(action.choices or ())
    raise AssertionError("SGLang's parser has no --hicache-storage-backend")


def command_line(flags: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """``flags`` (``ServerArgs`` field names) as SGLang's command line, and the values it
    cannot carry (module docstring): ``None`` and ``False`` are left out, ``True`` is a
    bare flag."""
    argv: list[str] = []
    python_only: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None or value is False:
            continue
        if (name == "hicache_storage_backend" and value not in _storage_choices()) or (
            name == "hicache_size" and not float(value).is_integer()
        ):
            python_only[name] = value
            continue
        option = "--" + name.replace("_", "-")
        argv += [option] if value is True else [option, str(value)]
    return argv, python_only


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse prints and exits; a test wants the message
        raise ParserRefused(message)


def parse(argv: list[str]) -> Any:
    """What ``prepare_server_args(argv)`` does, but for its logging set-up (0.5.23's takes
    the process's root logger over with ``basicConfig(force=True)``, pytest's log capture
    with it): SGLang's parser with SGLang's options, then ``ServerArgs.from_cli_args``.
    :class:`ParserRefused` says what the parser refused."""
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    try:
        raw = parser.parse_args(argv)
    except ParserRefused as e:
        raise ParserRefused(f"SGLang's command line refused {argv}: {e}") from None
    return ServerArgs.from_cli_args(raw)


def server_args(flags: dict[str, Any]) -> Any:
    """``ServerArgs`` for ``flags`` through SGLang's parser (see the module docstring)."""
    argv, python_only = command_line(flags)
    args = parse(argv)
    for name, value in python_only.items():
        setattr(args, name, value)
    return args

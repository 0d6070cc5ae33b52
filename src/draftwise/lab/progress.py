"""Progress bars of long commands (`check`, `bench`, `profile`): done / total, elapsed, ETA, on stderr.

A bar is drawn only where a person watches: when stderr is a terminal, or when the user forces
it (`--progress`); `--no-progress` turns it off everywhere. It never writes to stdout, so a
command's machine-readable output stays parseable whatever the setting. `mode` is that choice:
True (forced), False (off) or None (stderr is a terminal).
"""
from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


def wanted(mode: bool | None) -> bool:
    """Is a bar drawn under `mode`?"""
    return bool(mode) if mode is not None else sys.stderr.isatty()


def stderr_console(mode: bool | None) -> Console:
    """The console for a command's messages and its bar: stderr, treated as a terminal when the bar
    is forced (rich otherwise prints a bar only once, at its end, into a file or a pipe)."""
    return Console(stderr=True, force_terminal=True if mode else None)


def make_progress(console: Console, mode: bool | None, transient: bool = False) -> Progress:
    """A bar of `done/total` units (requests, steps, points) with the elapsed time and an ETA; a
    bar that draws nothing (but counts) when `mode` says no bar."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=transient,
                    disable=not wanted(mode))

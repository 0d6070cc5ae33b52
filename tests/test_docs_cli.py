"""docs/cli.md stays true to the argument parsers: every subcommand has a section, every option of
its parser a row with the parser's default, and no row names an option the parser lacks."""
import argparse
import re
from pathlib import Path

from draftwise.cli.main import build_parser

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    return "-" if action.default is None else f"`{action.default}`"


def _parser_options() -> dict[str, dict[str, str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, p in sub.choices.items():
        opts = {}
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            key = a.option_strings[0] if a.option_strings else a.dest.upper()
            opts[key] = _default(a)
        out[name] = opts
    return out


def _doc_options(text: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"## draftwise (\S+)$", line)
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        m = re.match(r"\| `([^`]+)`[^|]* \| ([^|]*?) \|", line)
        if cur is not None and m and m.group(1) != "option":
            cur[m.group(1)] = m.group(2)
    return out


def test_every_subcommand_and_option_is_documented_with_its_default():
    parsers, doc = _parser_options(), _doc_options(DOC.read_text())
    assert set(doc) == set(parsers), "docs/cli.md sections differ from the subcommands"
    for name, opts in parsers.items():
        missing = set(opts) - set(doc[name])
        extra = set(doc[name]) - set(opts)
        assert not missing, f"draftwise {name}: options missing from docs/cli.md: {sorted(missing)}"
        assert not extra, f"draftwise {name}: docs/cli.md names options the parser lacks: {sorted(extra)}"
        for opt, default in opts.items():
            assert doc[name][opt] == default, f"draftwise {name} {opt}: docs say {doc[name][opt]}, parser {default}"


def test_the_check_sees_a_row_that_is_not_in_the_parser():
    text = DOC.read_text().replace("| `--k` | `4` |", "| `--kk` | `4` |", 1)
    assert _doc_options(text) != _doc_options(DOC.read_text())

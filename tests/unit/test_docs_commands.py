"""Every `tgw-broker ...` command that README.md and docs/*.md show exists: each subcommand path
runs with `--help` (exit 0), and each `--flag` shown beside it is one of that command's flags.

Commands are read from inline code spans and fenced code blocks (a block's `# comments` are
prose, skipped); prose outside code is not a command.
"""
from __future__ import annotations

import argparse
import glob
import os
import re

import pytest

from tgw.broker.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
COMMAND = re.compile(r"(?<![\w./-])(?:\S*/)?tgw-broker((?:[ \t]+[^\s|;&`#]+)*)")
FENCE = re.compile(r"^\s*```")


def code_of(text: str) -> list[str]:
    """The document's code: each fenced block's lines (comments cut) and each inline code span."""
    code, in_block = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_block = not in_block
        elif in_block:
            code.append(re.sub(r"(^|\s)#.*", "", line))
        else:
            code += re.findall(r"`([^`]+)`", line)
    return code


def shown_commands() -> dict[tuple[str, ...], set[str]]:
    """(subcommand path) -> the flags shown with it, over every document; the path is what the
    parser takes as subcommands, so a missing one is left in it for the test to refuse."""
    shown: dict[tuple[str, ...], set[str]] = {}
    for doc in DOCS:
        with open(doc) as f:
            for snippet in code_of(f.read()):
                for match in COMMAND.finditer(snippet):
                    path, flags = subcommand_path(match.group(1).split())
                    if path:
                        shown.setdefault(path, set()).update(flags)
    return shown


def subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def subcommand_path(words: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """The words naming subcommands (walking the parser: a word where a subcommand is due is
    one, known or not) and the --flags among the rest."""
    parser, path = cli.build_parser(), []
    for i, word in enumerate(words):
        choices = subparsers_of(parser)
        if not choices or word.startswith("-") or placeholder(word):
            return tuple(path), re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", " ".join(words[i:]))   # "[--json]" too
        path.append(word)
        if word not in choices:
            break
        parser = choices[word]
    return tuple(path), []


def placeholder(word: str) -> bool:
    """"…", "...", "VERB", "<verb>", "{a,b}": the docs standing for a command, not naming one."""
    return word in ("…", "...") or word.isupper() or word[0] in "<[{"


SHOWN = shown_commands()


def test_the_docs_show_commands():
    """The reader works: the docs show the verbs a newcomer meets first."""
    assert {("start",), ("check-config",), ("status",), ("models", "load")} <= set(SHOWN), sorted(SHOWN)


@pytest.mark.parametrize("path", sorted(SHOWN), ids=" ".join)
def test_each_command_the_docs_show_runs_with_help(path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*path, "--help"])
    out = capsys.readouterr()
    assert exit_info.value.code == 0, f"`tgw-broker {' '.join(path)}` as the docs show it: {out.err}"
    assert out.out.startswith(f"usage: tgw-broker {' '.join(path)}")
    known = {flag for action in parser_of(path)._actions for flag in action.option_strings}
    assert SHOWN[path] <= known, f"`tgw-broker {' '.join(path)}` has no {sorted(SHOWN[path] - known)}"


def parser_of(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    for word in path:
        parser = subparsers_of(parser)[word]
    return parser


def test_a_missing_command_is_caught():
    """What the docs once showed (`tgw-broker stats`) fails the check; prose and comments are not read."""
    assert subcommand_path(["stats"]) == (("stats",), [])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["stats", "--help"])
    assert exit_info.value.code != 0
    snippets = code_of("the tgw-broker and tgw-bench commands\n```\ntgw-broker status  # tgw-broker nope\n```\n"
                       "run `tgw-broker models load m --path x.pt [--weight 5]`, `tgw-broker models …`")
    found = [subcommand_path(m.group(1).split()) for s in snippets for m in COMMAND.finditer(s)]
    assert found == [(("status",), []), (("models", "load"), ["--path", "--weight"]), (("models",), [])]

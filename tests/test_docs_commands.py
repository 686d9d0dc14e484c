"""Every pipesim command docs/*.md shows parses with the command line's own parser, as written.

A command is a line of a ```bash block (continuations joined and comments dropped as tests/helpers.py's
`bash_commands` does) or a `$ ` line of any fenced block (a transcript: the lines up to the next `$ ` line are what
it prints). Each `pipesim` step of it is parsed by click (`make_context` on the command, nothing invoked), so a
renamed or removed flag or command and a value of the wrong type fail here, naming the doc and line, in seconds and
without a simulation. A `pipesim ...` code span in the prose is a mention: it is parsed too, but may leave out what
the command requires. benchmarks/docs_commands.py runs the fenced commands for real and compares transcripts.

A placeholder is not a command: a step with an argument written as a metavar is (capitals, as PATH, R, TRACE...),
or holding `...` or `<...>`, is left out, by that rule alone.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import pytest
import typer

from pipesim.cli import make_app
from tests.helpers import bash_commands as _commands

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", flags=re.S | re.M)
PROMPT = "$ "
SHELL_OPERATORS = ("&&", "||", ";", "|")
METAVAR = re.compile(r"[A-Z][A-Z0-9_]*(\.\.\.)?")
PLACEHOLDER = re.compile(r"\.\.\.|<[^>]*>")
MENTION = re.compile(r"`(pipesim [^`]+)`")


@dataclass(frozen=True)
class DocCommand:
    """One command of a doc: where it is, the shell line, and what the doc shows it print (None: no transcript)."""

    doc: str
    line: int
    command: str
    shown: str | None = None

    @property
    def where(self) -> str:
        return f"docs/{self.doc}:{self.line}"


def _logical_lines(text: str, first_line: int) -> list[tuple[int, str]]:
    """(line number, line) with each backslash continuation kept with the line it continues."""
    lines: list[tuple[int, str]] = []
    joining = False
    for offset, line in enumerate(text.splitlines(keepends=True)):
        if joining:
            lines[-1] = (lines[-1][0], lines[-1][1] + line)
        else:
            lines.append((first_line + offset, line))
        joining = line.rstrip("\n").endswith("\\")
    return lines


def _block_commands(doc: str, text: str, first_line: int) -> list[DocCommand]:
    """A ```bash block's commands, each at the line it starts on."""
    return [DocCommand(doc, line, command) for line, logical in _logical_lines(text, first_line)
            for command in _commands(logical)]


def _transcript(doc: str, text: str, first_line: int) -> list[DocCommand]:
    """A fenced block's `$ ` commands, each with the lines that follow it up to the next `$ ` line."""
    found: list[DocCommand] = []
    for line, logical in _logical_lines(text, first_line):
        if logical.startswith(PROMPT):
            found.extend(DocCommand(doc, line, command, "") for command in _commands(logical[len(PROMPT):]))
        elif found:
            found[-1] = replace(found[-1], shown=found[-1].shown + logical)
    return found


@cache
def doc_commands(doc: Path) -> tuple[DocCommand, ...]:
    """The doc's commands in its order. A ```bash block followed by a plain fenced block, with nothing between
    them, is a transcript too: the plain block is what the bash block's last command prints."""
    text = doc.read_text()
    found: list[DocCommand] = []
    after_commands = None  # where the last ```bash block with commands ends, while no other block follows it
    for block in FENCE.finditer(text):
        language, body = block.groups()
        first_line = text.count("\n", 0, block.start()) + 2
        if language == "bash":
            commands = _block_commands(doc.name, body, first_line)
            found.extend(commands)
            after_commands = block.end() if commands else None
            continue
        if language == "" and body.startswith(PROMPT):
            found.extend(_transcript(doc.name, body, first_line))
        elif language == "" and after_commands is not None and not text[after_commands:block.start()].strip():
            found[-1] = replace(found[-1], shown=body)
        after_commands = None
    return tuple(found)


@cache
def doc_mentions(doc: Path) -> tuple[DocCommand, ...]:
    """The doc's `pipesim ...` code spans in its prose, each as one line (a span may wrap)."""
    text = FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), doc.read_text())
    return tuple(DocCommand(doc.name, text.count("\n", 0, span.start()) + 1, " ".join(span.group(1).split()))
                 for span in MENTION.finditer(text))


def pipesim_steps(command: str) -> list[list[str]]:
    """The arguments of each `pipesim` step of a shell line (steps joined by &&, ||, ; or |)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    steps: list[list[str]] = [[]]
    for token in lexer:
        if token in SHELL_OPERATORS:
            steps.append([])
        else:
            steps[-1].append(token)
    return [step[1:] for step in steps if step[:1] == ["pipesim"]]


def is_placeholder(args: list[str]) -> bool:
    """An argument written as a metavar (PATH, R, TRACE...) or holding `...` or `<...>`: a form, not a command."""
    return any(METAVAR.fullmatch(arg) or PLACEHOLDER.search(arg) for arg in args)


@cache
def _group() -> typer.core.TyperGroup:
    return typer.main.get_command(make_app())


def parse(args: list[str], mention: bool = False) -> str | None:
    """Parse `pipesim ARGS` as the command line does, without running it: None, or the usage error it prints. A
    mention in prose names a command and some of its flags: a required option or argument it leaves out, or the
    value of the flag it ends with, is not missing."""
    group = _group()
    context = typer.Context(group, info_name="pipesim")
    try:
        name, command, rest = group.resolve_command(context, list(args))
        if mention and rest and any(rest[-1] in param.opts and not param.is_flag for param in command.params):
            rest = rest[:-1]
        command.make_context(name, rest, parent=context).close()
    except Exception as error:
        if not callable(getattr(error, "format_message", None)):  # click's usage errors, as cli.main tells them
            raise
        if mention and type(error).__name__ == "MissingParameter":
            return None
        return error.format_message()
    return None


ALL_COMMANDS = [command for doc in DOCS for command in doc_commands(doc)]


def test_the_docs_show_commands_and_transcripts():
    steps = [args for command in ALL_COMMANDS for args in pipesim_steps(command.command)]
    assert len(steps) >= 50
    assert sum(command.shown is not None for command in ALL_COMMANDS) >= 10
    assert {command.doc for command in ALL_COMMANDS} >= {"simulate.md", "hardware.md", "auto.md", "run-and-compare.md"}


@pytest.mark.parametrize(("args", "placeholder"), [
    (["view", "TRACE...", "--html", "OUT"], True),
    (["simulate", "-s", "auto", "--activation-limit", "R"], True),
    (["run", "--profile", "<file>"], True),
    (["simulate", "-s", "1f1b", "..."], True),
    (["simulate", "-s", "1f1b", "-D", "4", "--trace", "t.json"], False),
    (["count", "--model", "hf:examples/llama3.1-70b", "--dtype", "bf16"], False),
])
def test_the_placeholder_rule(args, placeholder):
    assert is_placeholder(args) is placeholder


def test_transcripts_are_split_at_each_prompt():
    commands = _transcript("x.md", "$ pipesim schedules  # all\nline 1\n$ pipesim gpus \\\n  --json\nerror: x\n", 5)
    assert commands == [DocCommand("x.md", 5, "pipesim schedules", "line 1\n"),
                        DocCommand("x.md", 7, "pipesim gpus    --json", "error: x\n")]


@pytest.mark.parametrize("args", [["simulate", "--no-such-flag"], ["simulate", "-p", "four"], ["simulated"],
                                  ["export", "--format", "no-such-format"]])
def test_the_parser_refuses_what_the_command_line_refuses(args):
    assert parse(args)


@pytest.mark.parametrize(("args", "wrong"), [
    (["run", "--profile"], None),
    (["compare", "--html"], None),
    (["estimate"], None),
    (["run", "--no-such-flag"], "No such option: --no-such-flag"),
    (["simulate", "--stages", "four"], "Invalid value for '--stages' / '-p'"),
])
def test_a_mention_may_leave_out_values_not_name_wrong_flags(args, wrong):
    error = parse(args, mention=True)
    assert error is None if wrong is None else error.startswith(wrong)


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_every_docs_command_parses(doc):
    wrong = []
    for command, mention in [*((command, False) for command in doc_commands(doc)),
                             *((command, True) for command in doc_mentions(doc))]:
        for args in pipesim_steps(command.command):
            if not is_placeholder(args) and (error := parse(args, mention)) is not None:
                wrong.append(f"{command.where}: pipesim {shlex.join(args)}\n    {error}")
    assert not wrong, "\n".join(wrong)


def test_the_runner_leaves_out_a_tables_box_and_its_widths():
    """benchmarks/docs_commands.py compares a transcript word by word: a rich table's box, corners and joints too,
    and its column widths are no difference; its figures are."""
    from benchmarks.docs_commands import shows

    shown = "┏━━━┳━━━┓\n┃ a ┃ b ┃\n┡━━━╇━━━┩\n│ 1 │ 2 │\n└───┴───┘\n"
    printed = "a title\n┏━━━━━┳━━━┓\n┃ a   ┃ b ┃\n┡━━━━━╇━━━┩\n│ 1   │ 2 │\n└─────┴───┘\nrows: 1\n"
    assert shows(shown, printed)
    assert not shows(shown.replace("2", "3"), printed)


def test_the_runner_fails_a_command_that_prints_a_traceback(tmp_path):
    """Bad input shows no traceback whatever the exit code (tests/test_readme.py fails the README's likewise)."""
    from benchmarks.docs_commands import run

    printing = DocCommand("x.md", 1, "echo 'Traceback (most recent call last):' >&2; echo done", "done\n")
    assert run(printing, tmp_path, dict(os.environ), 60).status == "failed"
    assert run(replace(printing, command="echo done"), tmp_path, dict(os.environ), 60).status == "ran"


def test_the_runners_diff_lists_what_differs_not_what_the_excerpt_leaves_out():
    from benchmarks.docs_commands import short_diff

    shown = " a   1\n b   2\n"
    printed = "a caption\n\n a 1\n b 3\n\nthe notes below\nmore notes\n"
    assert short_diff(shown, printed) == "- b 2\n+ b 3"
    assert short_diff(" caption x\n a 1\n", printed) == "- caption x\n+ a caption"


@pytest.mark.parametrize("timeout", ["0", "-5", "nan", "inf"])
def test_the_runner_refuses_a_timeout_no_command_can_run_within(timeout, monkeypatch, capsys):
    """Checked before the docs are: an unknown doc named too keeps a broken check from running them all."""
    from benchmarks.docs_commands import main

    monkeypatch.setattr("sys.argv", ["docs_commands.py", "no-such.md", "--timeout", timeout])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2  # it read "--timeout must be a finite number of seconds above 0", words of its own
    assert capsys.readouterr() == ("", f"error: argument --timeout: give a finite number above 0 (got {timeout})\n")

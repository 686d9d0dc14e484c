"""Run every command docs/*.md shows, as written, and compare each transcript with what the doc shows it print.

    python benchmarks/docs_commands.py [DOC ...] [--timeout 120] [--gpu] [--ranks]

The commands are tests/test_docs_commands.py's (which only parses them). Each doc's commands run in its order in a
fresh folder holding the repository's examples/, traces/ and benchmarks/, as tests/test_readme.py runs the
README's, one host cache shared by all docs. A command is:
- ran: it exited 0 and, for a transcript, printed what the doc shows; a transcript that shows `error: ...` expects
  exit 2 and that line.
- differs: a transcript whose printed output (stdout and stderr, as a terminal shows them) is not the doc's:
  compared word by word, so a wrapped caption or a table's column widths do not count; the doc's block is an
  excerpt (what it leaves out before and after is no difference), `...` or `…` in it stands for any words, and
  box-drawing rules are left out. A block may show a file the command wrote (export's CSV) instead.
- failed: another exit code, or a traceback printed (bad input shows none, whatever the exit code).
- timed out: still running after --timeout seconds (its whole process group is stopped); a later command that
  reads what it writes then fails too.
- skipped: a placeholder (tests/test_docs_commands.py's rule), one that needs a GPU (`cuda`, `nccl`) unless --gpu,
  or one started under torchrun (torch.distributed ranks of its own) unless --ranks.
Prints a table per doc and, below it, each command that did not run as shown, with its error or a short diff.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipesim.commands.tables import print_table

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # the repository's tests/, whose readers of the docs this runs

from benchmarks.one_line_parser import OneLineParser, positive_number  # noqa: E402
from tests.test_docs_commands import DOCS, DocCommand, doc_commands, is_placeholder, pipesim_steps  # noqa: E402
from tests.test_readme import SHARED_PATHS, user_folder  # noqa: E402

ELISIONS = ("...", "…")
RULE = re.compile(r"[\u2500-\u257f+|-]+")  # box drawing (a rule, its corners and joints), + | -
ERROR_PREFIX = "error:"
TRACEBACK = "Traceback (most recent call last):"
USAGE_EXIT = 2
GPU_WORDS = ("cuda", "nccl")
DISTRIBUTED_LAUNCHERS = ("torchrun",)
DIFF_LINES = 12
STATUSES = ("ran", "differs", "failed", "timed out", "skipped")


@dataclass
class Outcome:
    """What one command did: its status (one of STATUSES), why, and its wall seconds."""

    command: DocCommand
    status: str
    detail: str = ""
    seconds: float = 0.0


def words(text: str) -> list[str]:
    """The words of a printed text, box-drawing rules left out."""
    return [word for word in text.split() if not RULE.fullmatch(word)]


def matches(pattern: list[str], text: list[str]) -> bool:
    """Whether the words `text` are the words `pattern`, an elision in it standing for any words (glob matching)."""
    at = seen = 0
    star = mark = -1
    while seen < len(text):
        if at < len(pattern) and pattern[at] in ELISIONS:
            star, mark, at = at, seen, at + 1
        elif at < len(pattern) and pattern[at] == text[seen]:
            at, seen = at + 1, seen + 1
        elif star >= 0:
            mark += 1
            at, seen = star + 1, mark
        else:
            return False
    return all(word in ELISIONS for word in pattern[at:])


def shows(shown: str, printed: str) -> bool:
    """Whether the doc's excerpt `shown` is in `printed`, word by word; the excerpt may leave out what comes before
    and after it (a caption, the rows below)."""
    return matches([ELISIONS[0], *words(shown), ELISIONS[0]], words(printed))


def short_diff(shown: str, printed: str) -> str:
    """The doc's lines that differ from the printed ones (-) and what was printed in their place (+), spaces
    collapsed, rules and blank lines left out; a doc line with an elision is the printed line it matches, and
    printed lines the excerpt leaves out are not differences."""
    def lines(text: str) -> list[str]:
        return [" ".join(words(line)) for line in text.splitlines() if words(line)]

    out = lines(printed)
    doc = [next((line for line in out if matches(shown_line.split(), line.split())), shown_line)
           for shown_line in lines(shown)]
    matched = [block for block in difflib.SequenceMatcher(None, doc, out).get_matching_blocks() if block.size]
    if matched:  # the printed lines the excerpt spans: as many before its first match and after its last as it shows
        first, last = matched[0], matched[-1]
        out = out[max(0, first.b - first.a):last.b + last.size + len(doc) - last.a - last.size]
    diff = []
    for change, doc_from, doc_to, out_from, out_to in difflib.SequenceMatcher(None, doc, out).get_opcodes():
        if change in ("replace", "delete"):
            diff += [f"- {line}" for line in doc[doc_from:doc_to]] + [f"+ {line}" for line in out[out_from:out_to]]
    more = [f"... ({len(diff) - DIFF_LINES} more lines)"] if len(diff) > DIFF_LINES else []
    return "\n".join(diff[:DIFF_LINES] + more)


def written(folder: Path, since: float) -> list[Path]:
    """The files under `folder` (the shared folders left out) written since `since`."""
    return [path for path in folder.rglob("*") if path.is_file() and path.stat().st_mtime >= since
            and path.relative_to(folder).parts[0] not in SHARED_PATHS]


def skip_reason(command: DocCommand, gpu: bool, ranks: bool) -> str | None:
    """Why the command is not run here, or None."""
    if any(is_placeholder(args) for args in pipesim_steps(command.command)):
        return "a placeholder"
    shell_words = shlex.split(command.command)
    if not gpu and any(word in GPU_WORDS for word in shell_words):
        return "needs a GPU (--gpu runs it)"
    if not ranks and shell_words[:1] and shell_words[0] in DISTRIBUTED_LAUNCHERS:
        return "starts torch.distributed ranks (--ranks runs it)"
    return None


def run(command: DocCommand, folder: Path, env: dict[str, str], timeout_s: float) -> Outcome:
    """Run one command in `folder` and judge it against the doc. A block may show a file the command wrote (the
    CSV `export -o` writes) rather than what it printed: each file it wrote is compared too."""
    start, began = time.perf_counter(), time.time()
    process = subprocess.Popen(["bash", "-c", command.command], cwd=folder, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, process_group=0)
    try:
        printed, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return Outcome(command, "timed out", f"past --timeout {timeout_s:g} s", time.perf_counter() - start)
    seconds = time.perf_counter() - start
    expects_error = command.shown is not None and command.shown.lstrip().startswith(ERROR_PREFIX)
    if process.returncode != (USAGE_EXIT if expects_error else 0) or TRACEBACK in printed:
        last = "\n".join(printed.splitlines()[-DIFF_LINES:])
        return Outcome(command, "failed", f"exit {process.returncode}:\n{last}", seconds)
    if command.shown is None:
        return Outcome(command, "ran", "", seconds)
    outputs = [printed, *(path.read_text(errors="replace") for path in written(folder, began))]
    if any(shows(command.shown, output) for output in outputs):
        return Outcome(command, "ran", "", seconds)
    closest = max(outputs, key=lambda output: difflib.SequenceMatcher(None, command.shown, output).ratio())
    return Outcome(command, "differs", short_diff(command.shown, closest), seconds)


def run_doc(doc: Path, cache: Path, timeout_s: float, gpu: bool, ranks: bool) -> list[Outcome]:
    """Every command of one doc, in its order, in a fresh folder."""
    outcomes = []
    with tempfile.TemporaryDirectory(prefix=f"docs-{doc.stem}-") as folder:
        env = user_folder(Path(folder), cache)
        env.pop("COLUMNS", None)  # print at a pipe's 120 columns (commands/common.py), not the runner's terminal's
        for command in doc_commands(doc):
            reason = skip_reason(command, gpu, ranks)
            outcome = Outcome(command, "skipped", reason) if reason else run(command, Path(folder), env, timeout_s)
            print(f"{command.where}: {outcome.status} ({outcome.seconds:.1f} s)", file=sys.stderr, flush=True)
            outcomes.append(outcome)
    return outcomes


def report(outcomes: dict[str, list[Outcome]], console: Console) -> None:
    """The summary table, then each command that did not run as the doc shows."""
    table = Table(title="docs/*.md commands, run as written")
    for column in ("doc", "commands", "transcripts", *STATUSES, "seconds"):
        table.add_column(column, justify="left" if column == "doc" else "right")
    for doc, done in outcomes.items():
        counts = [sum(outcome.status == status for outcome in done) for status in STATUSES]
        table.add_row(doc, str(len(done)), str(sum(outcome.command.shown is not None for outcome in done)),
                      *map(str, counts), f"{sum(outcome.seconds for outcome in done):.0f}")
    print_table(table)
    for done in outcomes.values():
        for outcome in done:
            if outcome.status != "ran":
                console.print(f"\n{outcome.command.where} {outcome.status}: {outcome.command.command}",
                              highlight=False, markup=False)
                if outcome.detail:
                    console.print("    " + outcome.detail.replace("\n", "\n    "), highlight=False, markup=False)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("docs", nargs="*", help="docs to run, by file name (default: every docs/*.md)")
    parser.add_argument("--timeout", type=positive_number, default=120,  # 0 or less times every command out
                        help="seconds one command may take (default 120)")
    parser.add_argument("--gpu", action="store_true", help="also run the commands that need a GPU")
    parser.add_argument("--ranks", action="store_true", help="also run the commands started under torchrun")
    args = parser.parse_args(argv)
    known = {doc.name: doc for doc in DOCS}
    unknown = [name for name in args.docs if name not in known]
    if unknown:
        parser.error(f"no such doc: {', '.join(unknown)} (docs/ holds {', '.join(known)})")
    outcomes = {}
    with tempfile.TemporaryDirectory(prefix="docs-cache-") as cache:
        for doc in [known[name] for name in args.docs] or DOCS:
            outcomes[doc.name] = run_doc(doc, Path(cache), args.timeout, args.gpu, args.ranks)
    report(outcomes, Console(highlight=False, soft_wrap=True))


if __name__ == "__main__":
    main()

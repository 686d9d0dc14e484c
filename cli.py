"""The `pipesim` command line: the typer app and its entry point. Each command lives in its own module under
commands/ and imports what it needs only when it runs, so `pipesim simulate` starts fast and never imports
torch."""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import typer


def _wrap_between_words() -> None:
    """Help wraps between words only, never after a hyphen: click's wrapper broke `--fp8-param-gather` after
    `param-` at 80 columns, and the half a user copied is no flag. Click has no setting for it: its wrap_text takes
    the TextWrapper of its `_textwrap` module at each call, in the click whose HelpFormatter lays out every help
    (typer 0.29 carries its own copy, older ones use click's). A click laid out otherwise keeps its own wrapping."""
    try:
        formatting = sys.modules[typer.core.TyperCommand.context_class.formatter_class.__module__]
        module = importlib.import_module(f"{formatting.__package__}._textwrap")
        wrapper = module.TextWrapper
    except (AttributeError, KeyError, ImportError):
        return

    class WholeWords(wrapper):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, break_on_hyphens=False, **kwargs)

    module.TextWrapper = WholeWords


_wrap_between_words()


@dataclass(frozen=True)
class Command:
    """A command: the module under commands/ that holds it, its function there, and its line in `pipesim --help`'s
    list, the function's docstring's first sentence, which fits at 80 columns (click cuts a longer one). The list
    is written here so that `pipesim --help` and `--version` import no command's module: building all thirteen
    imported numpy, pydantic and rich, about 0.3 of their 0.4 CPU seconds."""

    module: str
    function: str
    summary: str

    def load(self) -> Callable[..., None]:
        return getattr(importlib.import_module(f".commands.{self.module}", __package__), self.function)


# The commands in the order `pipesim --help` lists them.
COMMANDS = {
    "simulate": Command("simulate", "simulate", "Predict schedules' timelines, bubbles, memory and staleness."),
    "calibrate": Command("calibrate", "calibrate", "Measure a model on this machine into a profile."),
    "run": Command("run", "run", "Run a schedule for real with torch, and trace it."),
    "export": Command("simulate", "export", "Write a method's training step for another runtime."),
    "sweep": Command("sweep", "sweep", "Simulate a grid of configurations; find their Pareto fronts."),
    "schedules": Command("simulate", "list_schedules",
                         "List the methods, what each does and the weights its ops read."),
    "tune": Command("tune", "tune", "Pick the fastest schedule and shape under a memory cap."),
    "compare": Command("compare", "compare", "Compare a measured run with its prediction op by op."),
    "view": Command("view", "view", "Draw traces on one self-contained page (works offline)."),
    "study": Command("study", "study", "Train every method alike: accuracy, throughput and staleness."),
    "count": Command("count", "count", "Count a model's work per layer on torch's meta device."),
    "gpus": Command("gpus", "gpus", "List the GPUs pipesim knows and their figures."),
    "estimate": Command("estimate", "estimate", "Estimate a model's profile on a catalogue GPU, without the GPU."),
}


def _print_version(asked: bool) -> None:
    """--version: the installed pipesim's version, as its package metadata records it."""
    if asked:
        from importlib import metadata

        print(f"pipesim {metadata.version('pipesim')}")
        raise typer.Exit()


Version = Annotated[bool, typer.Option(
    "--version", is_eager=True, callback=_print_version, help="Print pipesim's version and exit.")]


def _options(version: Version = False) -> None:
    """The options of `pipesim` itself, before a command: a group even with one command registered, so
    `pipesim simulate` names it."""


class _Argument(typer.core.TyperArgument):
    """An argument named as click names it: "MEASURED [PREDICTED]" and "TRACE..." in the usage line, not
    typer's "{MEASURED} [[PREDICTED]]"; in the help, its metavar alone where it has one, as an option's is, not
    "TRACE... <list[Path]>"."""

    def get_usage_pieces(self, ctx) -> list[str]:
        name = self.metavar or self.name.upper()
        name = name if self.required else f"[{name}]"
        return [name if self.nargs == 1 or name.endswith("...") else f"{name}..."]

    def display_type_rich(self, ctx) -> str | None:
        return None if self.metavar is not None else super().display_type_rich(ctx)


class _Command(typer.core.TyperCommand):
    """A command whose arguments are `_Argument`s (typer builds its own parameter classes, so they are
    re-classed here)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if type(param) is typer.core.TyperArgument:
                param.__class__ = _Argument

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        """Refuses an option of one value given twice, of which click kept the last alone: `run -s 1f1b -s xpipe`
        ran xpipe only and `simulate -p 2 -p 4` p = 4 only, exit 0, where the user asked for both. An option that
        takes several values (simulate's -s, sweep's axes) adds each one given; a flag given twice is still on."""
        _, _, given = self.make_parser(ctx).parse_args(args=list(args))
        for param in dict.fromkeys(given):
            times = given.count(param)
            if times == 1 or not isinstance(param, typer.core.TyperOption) or param.multiple or param.is_flag \
                    or param.count:
                continue
            from .commands.common import fail

            if "--schedule" in param.opts:
                fail(f"--schedule: given {times} times, and `pipesim {ctx.info_name}` runs one method; give one "
                     "(`pipesim simulate` compares several)")
            several = ", as one comma-separated list" if "[," in (param.metavar or "") else ""
            fail(f"{param.opts[0]}: given {times} times, and `pipesim {ctx.info_name}` takes one value; give it once"
                 f"{several}")
        return super().parse_args(ctx, args)


class _Listed(typer.core.TyperCommand):
    """A command as `pipesim --help` lists it, by its name and its line, its module not imported."""


class _Group(typer.core.TyperGroup):
    """`pipesim` itself: lists every command, and builds only the one it runs (typer builds a command's
    parameters, and its module imports what the command needs)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.commands = {name: self.commands.get(name) or _Listed(name=name, help=command.summary)
                         for name, command in COMMANDS.items()}

    def resolve_command(self, ctx, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        if isinstance(command, _Listed):
            command = self.commands[name] = typer.main.get_command(make_app((name,))).commands[name]
        return name, command, rest


# -h as well as --help, for pipesim and each command: many command lines take it for help, and no option here is -h
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}


def make_app(names: tuple[str, ...] = tuple(COMMANDS)) -> typer.Typer:
    """The typer app with the commands `names` built (all by default); the others are listed, and built when run."""
    app = typer.Typer(
        name="pipesim",
        help="Simulate, run and compare pipeline-parallel training schedules.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,  # plain help: wraps cleanly at 80 columns, and "[[a, b], ...]" is text, not markup
        cls=_Group,
        context_settings=HELP_OPTIONS,
    )
    app.callback()(_options)
    for name in names:
        app.command(name, cls=_Command, context_settings=HELP_OPTIONS)(COMMANDS[name].load())
    return app


def __getattr__(name: str) -> typer.Typer:
    """`app`: the whole command line, every command built, for code that inspects it (`main` builds only the
    command it runs)."""
    if name == "app":
        return make_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def _missing(exc: Exception) -> str | None:
    """A required option or argument left out, as one line naming it and saying in its help's words what it takes
    (click's own, "Missing option '--format'.", said not what to give); None for any other usage error."""
    param = getattr(exc, "param", None)
    if not hasattr(exc, "param_type") or param is None or not getattr(param, "help", None):
        return None
    if param.param_type_name == "option":  # with what to type after it: "--gpu NAME"
        name = f"{param.opts[0]} {param.metavar}" if param.metavar else param.opts[0]
    else:
        name = (param.metavar or param.name.upper()).rstrip(".")
    return f"{name} is required: {param.help}"


def _extra(exc: Exception, args: list[str]) -> str | None:
    """Words the command has no place for, as one line saying what it takes: a value given to a flag ("--memory is a
    flag and takes no value (got '0')"), else the command's arguments, or that it takes none. click said "Got
    unexpected extra argument(s) (0)". None for any other usage error."""
    ctx = getattr(exc, "ctx", None)
    command = getattr(ctx, "command", None)
    if command is None or not str(getattr(exc, "message", "")).startswith("Got unexpected extra argument") \
            or ctx.info_name not in args:
        return None
    rest = args[args.index(ctx.info_name) + 1:]
    try:
        _, extra, _ = command.make_parser(ctx).parse_args(args=list(rest))
    except Exception:  # noqa: BLE001 - click's own line then
        return None
    if not extra or extra[0] not in rest:
        return None
    before = rest[rest.index(extra[0]) - 1] if rest.index(extra[0]) else None
    flags = [param for param in command.params if getattr(param, "is_flag", False)]
    if any(before in (*param.opts, *param.secondary_opts) for param in flags):
        return f"{before} is a flag and takes no value (got {extra[0]!r}): give {before} alone"
    takes = " ".join(piece for param in command.params if param.param_type_name == "argument"
                     for piece in param.get_usage_pieces(ctx))
    got = ", ".join(map(repr, extra))
    what = f"takes {takes} (got {got} too)" if takes else f"takes no arguments, only options (got {got})"
    return f"`pipesim {ctx.info_name}` {what}; see `pipesim {ctx.info_name} --help`"


def _commands() -> dict:
    """Every command, built with all its options: what a usage error's line reads of the others (an error's path,
    built once there)."""
    return typer.main.get_command(make_app()).commands


def _no_value(exc: Exception, args: list[str]) -> str | None:
    """An option given last with no value, as one line saying what it takes: click said "Option '-s' requires an
    argument." (its error carries no context: the command is the first of `args`). None for any other usage
    error."""
    name = getattr(exc, "option_name", None)
    if (type(exc).__name__ != "BadOptionUsage" or not isinstance(name, str) or args[0] not in COMMANDS
            or not str(getattr(exc, "message", "")).endswith("requires an argument.")):
        return None
    command = _commands()[args[0]]
    param = next((param for param in command.params if name in param.opts), None)
    if param is None:
        return None
    long = next((opt for opt in param.opts if opt.startswith("--")), name)
    flag = name if name == long else f"{name} ({long})"
    return f"{flag} needs a value ({param.metavar or param.type.name.upper()})" + (
        f": {param.help}" if getattr(param, "help", None) else "")


def _unknown_option(exc: Exception) -> str | None:
    """An option the command does not take, as one line: the command's own option nearest it where one is near (a
    long one), and the commands that take it where others do, with the long name a short one stands for there.
    click suggested any option of the command, however far ("No such option: --zero (Possible options: --lr)" for
    `pipesim run --zero 1`, a flag of simulate, sweep and tune), and said of a short one only "No such option: -m"."""
    ctx, name = getattr(exc, "ctx", None), getattr(exc, "option_name", None)
    # click's NoSuchOption, by name: typer vendors click (typer._click) where older typers import it
    if (type(exc).__name__ != "NoSuchOption" or ctx is None or not isinstance(name, str)
            or not name.startswith("-") or len(name) < 2 or name == "--" or ctx.info_name not in COMMANDS):
        return None
    from .choices import nearest_text

    def params(command) -> dict[str, str]:
        """Each option name of `command` and the long name it stands for."""
        return {opt: next((o for o in param.opts if o.startswith("--")), opt) for param in command.params
                for opt in (*param.opts, *getattr(param, "secondary_opts", ())) if opt.startswith("-")}

    built = _commands()
    others = [command for command in COMMANDS if command != ctx.info_name and name in params(built[command])]
    longs = {params(built[command])[name] for command in others}
    near = nearest_text(name, [opt for opt in params(ctx.command) if opt.startswith("--")], prefix="--") if (
        name.startswith("--")) else ""
    taken = ""
    if others:
        who = f"{', '.join(others[:-1])} and {others[-1]} take it" if len(others) > 1 else f"{others[0]} takes it"
        taken = f" ({who}{f', as {next(iter(longs))}' if len(longs) == 1 and name not in longs else ''})"
    return f"`pipesim {ctx.info_name}` has no option {name}{near}{taken}; see `pipesim {ctx.info_name} --help`"


def _bad_value(exc: Exception, args: list[str]) -> str | None:
    """An option's value click refused (a range, a type) as pipesim's own refusals say one: the flag as typed (`-j
    (--workers)`, where click named `--workers` alone), what a number option allows with its bounds grouped in
    thousands, and the value given, which typer's line left out ("Input should be greater than or equal to 1").
    A callback's own line (pipesim's "give a finite number ... (got nan)") keeps its words, as does an older typer's
    click, whose line names the value. None for any other usage error."""
    param = getattr(exc, "param", None)
    if param is None or param.param_type_name != "option" or not hasattr(exc, "message"):
        return None
    from .files import grouped
    from .units import given_text

    flag = _typed(param, args)
    errors = getattr(exc.__cause__, "errors", None)  # typer 0.2x converts with pydantic, which keeps the input
    if not callable(errors):
        return f"{flag}: {grouped(exc.message)}"
    said = f"{flag}: {_allowed(param) or grouped(exc.message)}"
    given = errors()[0].get("input")
    return said if given is None else f"{said} (got {given_text(str(given))})"


def _typed(param, args: list[str]) -> str:
    """The option `param` as the command line `args` named it: "-j (--workers)" where its short flag was typed (the
    long one is what help and pipesim's refusals say), else its long flag."""
    long = next((name for name in param.opts if name.startswith("--")), param.opts[0])
    shorts = [name for name in param.opts if not name.startswith("--")]
    for arg in args:
        if arg == "--":
            break
        if arg == long or arg.startswith(f"{long}="):
            return long
        if short := next((name for name in shorts if not arg.startswith("--") and arg.startswith(name)), None):
            return f"{short} ({long})"  # "-j 0" or "-j0"
    return long


def _allowed(param) -> str | None:
    """What a whole-number or number option takes with its bounds, "give a whole number from 1 to 1,000"; None for
    options of other types."""
    kind = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if kind not in (int, float):
        return None
    from .units import number_allowed

    return number_allowed(getattr(param, "min", None), getattr(param, "max", None), whole=kind is int)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: usage errors become one line and exit code 2, never a traceback; Ctrl-C is one
    line, "interrupted", and exit code 130 (outputs are written whole or not at all)."""
    args = (sys.argv[1:] if argv is None else argv) or ["--help"]  # bare `pipesim`: its help, on stdout, exit 0
    if args[0] == "help":  # `pipesim help [COMMAND]`, as git and pip take it: that one's --help
        args = [*args[1:2], "--help"]
    try:
        code = typer.main.get_command(make_app(())).main(args=args, prog_name="pipesim", standalone_mode=False)
    except KeyboardInterrupt:
        code = INTERRUPTED
    except typer.Abort as exc:  # older typer: click's Abort, from a KeyboardInterrupt among others
        code = INTERRUPTED if isinstance(exc.__cause__, KeyboardInterrupt) else 1
    except Exception as exc:
        if not callable(getattr(exc, "format_message", None)):
            raise
        from .commands.common import fail

        # click's usage and parameter errors
        fail(_missing(exc) or _bad_value(exc, args) or _extra(exc, args) or _unknown_option(exc)
             or _no_value(exc, args) or exc.format_message())
    finally:  # a command whose output went to the standard output printed to stderr (`_to_standard_output`): no more
        if (common := sys.modules.get(f"{__package__}.commands.common")) is not None:
            common.stdout.file = None
    if code == INTERRUPTED:  # typer turns a KeyboardInterrupt in a command into this exit code
        print("interrupted", file=sys.stderr)
    if argv is None:  # the process ends here: the interpreter's last collections over what torch and sympy made
        gc.freeze()  # took `pipesim calibrate` 0.5-1.4 s on the 2-core host; frozen, they are not scanned
        if (processes := sys.modules.get(f"{__package__}.workload.processes")) is not None:
            try:
                processes.stop()  # its forkserver, which may still be importing, ends with it, not seconds after
            except KeyboardInterrupt:  # a Ctrl-C as it ends (a run's ranks' second one): said once, no traceback
                if code != INTERRUPTED:
                    print("interrupted", file=sys.stderr)
                code = INTERRUPTED
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

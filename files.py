"""Reading the files users give: one-line errors that name the file and the first field that is wrong.

A leaf like `units`: the catalogue, the profile schema, the sweep's grid, cluster, graph, trace, study results,
Hugging Face config and torch schedule CSV files are read through it, so every file a user hands pipesim fails the
same way; and what tells pipesim's own traces and pages from other files, where one is given in another's place or
would be replaced."""

from __future__ import annotations

import codecs
import csv
import gzip
import json
import math
import re
import shlex
import sys
import types
import typing
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

from .choices import nearest_text

# The global every page pipesim draws sets before anything else runs (traces/view.py's health script): what tells
# its pages from any other file (commands/common.py `PAGE`, the pages an --html may replace)
PAGE_HEALTH = "window.pipesimHealth"


def read_toml(path: Path, error: type[Exception], prefix: str = "") -> dict:
    """The TOML document at `path`; an unreadable, non-UTF-8 or invalid file raises `error` (its message led by
    `prefix`, e.g. the flag that named the file)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    return _read(path, error, tomllib.loads, tomllib.TOMLDecodeError, "TOML", prefix, str(path))


def read_json(path: str | Path, error: type[Exception], what: str, prefix: str = "", give: str = "") -> Any:
    """The JSON document at `path`; an unreadable, non-UTF-8 or invalid file raises `error` naming it as `what`
    (e.g. "cluster file"), its message led by `prefix` (e.g. the flag that named the file); one that is no JSON at
    all but another of pipesim's outputs is named as such, followed by `give` (what to give instead)."""
    return _read(path, error, json.loads, json.JSONDecodeError, "JSON", prefix, f"{what} {path}", give)


def read_text(path: str | Path, error: type[Exception], prefix: str = "", named: str | None = None) -> str:
    """The UTF-8 text at `path`, less the byte-order mark Windows editors write (json refused a file saved so, a
    torch CSV's first cell read '\\ufeff0F0'); where it cannot be read or is not UTF-8, `error` led by `prefix`
    and naming the file as `named` (its path by default)."""
    named = str(path) if named is None else named
    try:
        if str(path).endswith(".gz"):  # torch.profiler's tensorboard_trace_handler writes .pt.trace.json.gz
            with gzip.open(path, "rt", encoding="utf-8-sig") as file:
                return file.read()
        return Path(path).read_text(encoding="utf-8-sig")
    except (EOFError, zlib.error) as exc:  # a gzip file cut short, or corrupt
        raise error(f"{prefix}{named} is not a whole gzip file ({exc})") from None
    except OSError as exc:  # gzip's BadGzipFile is one, with no strerror: its message says what is wrong
        raise error(f"{prefix}cannot read {named}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise error(f"{prefix}{named} is not a text (UTF-8) file") from None


def _read(path: str | Path, error: type[Exception], loads: Callable[[str], Any], invalid: type[Exception],
          language: str, prefix: str, named: str, give: str = "") -> Any:
    """The text at `path` (`read_text`) parsed by `loads`; where `loads` raises `invalid`, `error` led by `prefix`
    and naming the file as `named` (and what it looks like, then `give`, where `_looks_like` tells)."""
    text = read_text(path, error, prefix, named)
    try:
        return loads(text)
    except invalid as exc:
        looks = _looks_like(text) if language == "JSON" else None
        raise error(f"{prefix}{named} is {looks}, not {language}{'; give ' * bool(give)}{give}" if looks
                    else f"{prefix}{named} is not valid {language}: {exc}") from None
    # what the parser takes for valid but Python's limits refuse: a value nested past its recursion limit, a whole
    # number past its digits for a conversion (`sys.get_int_max_str_digits`); no file pipesim reads holds either
    except RecursionError:
        raise error(f"{prefix}{named} is not {language} pipesim reads: its values nest more than "
                    f"{sys.getrecursionlimit():,} deep") from None
    except ValueError:
        raise error(f"{prefix}{named} is not {language} pipesim reads: it holds a whole number of more than "
                    f"{sys.get_int_max_str_digits():,} digits") from None


def _looks_like(text: str) -> str | None:
    """What a file that is no JSON at all looks like, where it is one of pipesim's other outputs (a page, a sweep's
    .csv) given in a JSON file's place: the parser's "Expecting value: line 1 column 1" says only where it stopped."""
    head = text.lstrip()
    if not head:
        return "an empty file"
    first_line = head.split("\n", 1)[0].strip()
    if PAGE_HEALTH in text:
        return "a pipesim page (HTML), which a browser opens"
    if head.startswith("<"):
        return "an HTML or XML file"
    if _is_table(head):
        return f"a CSV table (its first line: {first_line[:60]}{'...' * (len(first_line) > 60)})"
    return None


def _is_table(head: str) -> bool:
    """Whether a text reads as a CSV table (a sweep's --out): its first two lines split into as many fields, two or
    more, and the first is no comment or TOML assignment. A comma alone does not make one: a TOML grid's comment, or
    JSON after a comment line, keeps the parser's own message."""
    lines = [line for line in head.splitlines()[:2] if line.strip()]
    if len(lines) < 2 or lines[0].lstrip().startswith(("#", "//", "{", "[", '"')) or "=" in lines[0]:
        return False
    counts = {len(row) for row in csv.reader(lines)}
    return len(counts) == 1 and counts.pop() >= 2


# pydantic's errors for a value that should have been an object, whose messages name its classes ("a valid
# dictionary or instance of LinkSpec"): said as its JSON mode says them, in the file's terms
_NOT_AN_OBJECT = frozenset({"model_type", "dict_type", "model_attributes_type"})
_UNIONS = (typing.Union, types.UnionType)  # what `get_origin` gives for `A | B` and `Optional[A]`
# pydantic's "Input should be a valid number" of a number given as text: what to give instead, and how text reads as
# one
_NUMBER = {"float_type": ("a number", float), "float_parsing": ("a number", float),
           "int_type": ("a whole number", int), "int_parsing": ("a whole number", int)}
_BOOLEAN = frozenset({"bool_type", "bool_parsing"})  # pydantic's "Input should be a valid boolean", in JSON's terms
_VALUE_SHOWN = 40  # a wrong value is shown up to this many characters (a 3,000-character string ran on)
_FIELDS_LISTED = 16  # an unknown field's refusal lists the fields allowed up to this many, or where none is near
# a bound as pydantic writes it, "1000" or "1000000000000", as a word of its own: not a path's or a name's digits,
# nor a value quoted as the user typed it ("'2024'", click's "'1234,5678' is not a valid integer")
_LONG_WHOLE = re.compile(r"(?<![\w./'\"])(?<!\d,)\d{4,}(?![\w./'\"]|,\d)")


def grouped(message: str) -> str:
    """`message` with its whole numbers of four digits or more grouped in thousands, as pipesim's own refusals
    write theirs ("1,000": five digits and more alone left "less than or equal to 1000"); a number in quotes or in
    a comma-separated run of digits is what the user typed and is kept as typed."""
    return _LONG_WHOLE.sub(lambda number: f"{int(number[0]):,}", message)


def first_error(exc: Any, model: Any = None) -> str:
    """A pydantic ValidationError's first error as `field.path: message` (just the message at the top level), its
    whole numbers grouped in thousands as pipesim's own refusals group theirs, the value given where it is one
    (`(got 'yes')`). An unknown field (a model that forbids extra ones) says the one meant where it is near one
    of those `model` (the type validated) allows there, and lists them (of many, only where none is near); a
    required field missing beside an unknown one is that one's error, misspelt ("memory_gb" for "memory_gib"), not
    the missing one's."""
    errors = exc.errors()
    missing = {err["loc"][:-1] for err in errors if err["type"] == "missing"}
    err = next((err for err in errors if err["type"] == "extra_forbidden" and err["loc"][:-1] in missing), errors[0])
    where = ".".join(map(str, err["loc"]))
    if err["type"] == "extra_forbidden":
        allowed = _fields_at(model, err["loc"][:-1])
        near = nearest_text(err["loc"][-1], allowed)
        listed = allowed and not (near and len(allowed) > _FIELDS_LISTED)  # a profile's layer has 40: the one meant
        message = f"unknown field{near}" + (f"; allowed: {', '.join(allowed)}" if listed else "")
    elif err["type"] == "missing":  # pydantic's "Field required", which said nothing of what to give
        kind = _kind_text(_annotation_at(model, err["loc"])) if model is not None else None
        message = f"missing: give {kind}" if kind else "required, and missing"
    else:
        given = err.get("input")
        message = ("Input should be an object" if err["type"] in _NOT_AN_OBJECT else "give true or false"
                   if err["type"] in _BOOLEAN else err["msg"].removeprefix("Value error, "))
        if err["type"] in _NUMBER:  # pydantic's "Input should be a valid number, unable to parse string as a number"
            kind, convert = _NUMBER[err["type"]]
            message = f"give {kind}" + (", without quotes" if _reads_as(given, convert) else "")  # memory_gib = "96"
        if isinstance(given, str | int | float) and "(got " not in message:
            message += f" (got {_value_text(given)})"
    return f"{where + ': ' if where else ''}{grouped(message)}"


def _reads_as(given: object, convert: Callable[[str], float]) -> bool:
    """Whether `given` is text that, its quotes dropped, `convert` (`_NUMBER`'s) reads as a finite number: "96", not
    "80GB" or, for a whole number, "1.5"."""
    if not isinstance(given, str):
        return False
    try:
        value = convert(given)
    except ValueError:
        return False
    return math.isfinite(value)


def _value_text(value: str | int | float) -> str:
    """A scalar of a file as its file writes it: text quoted, true and false, a float to 15 significant digits
    (1e15 read "1000000000000000.0"), a whole one with its ".0" (`gpus_per_node = 4.0` read "give a whole number
    (got 4)")."""
    if isinstance(value, bool):
        return json.dumps(value)
    text = f"{value:.15g}" if isinstance(value, float) else repr(value)
    if isinstance(value, float) and text.lstrip("-").isdigit():
        text += ".0"
    return text if len(text) <= _VALUE_SHOWN else f"{text[:_VALUE_SHOWN]}..."


def _models(annotation: Any) -> list[Any]:
    """The pydantic model classes an annotation can hold at its top (through Annotated and unions)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _models(get_args(annotation)[0])
    if origin in _UNIONS:
        return [m for arg in get_args(annotation) for m in _models(arg)]
    return [annotation] if hasattr(annotation, "model_fields") else []


def _step(annotation: Any, part: Any) -> Any:
    """The annotation at `part` (a field name or alias, a list index, a dict key) inside `annotation`; None where
    nothing is known there."""
    for found in _models(annotation):
        field = found.model_fields.get(part) or next((f for f in found.model_fields.values() if f.alias == part), None)
        if field is not None:
            return field.annotation
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _step(args[0], part)
    if origin in _UNIONS:
        return next((found for arg in args if (found := _step(arg, part)) is not None), None)
    if origin in (list, tuple, set, frozenset) and isinstance(part, int) and args:
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    return None


def _annotation_at(model: Any, loc: tuple) -> Any:
    """The annotation at `loc` inside `model` (a model class or any type holding models: lists, dicts, unions,
    Annotated); None where none is known."""
    annotation = model
    for part in loc:
        annotation = _step(annotation, part)
    return annotation


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """The field names a pydantic model at `loc` inside `model` allows, in its order; none where no model is
    there."""
    return [field.alias or name for found in _models(_annotation_at(model, loc))[:1]
            for name, field in found.model_fields.items()]


def _kind_text(annotation: Any) -> str | None:
    """What a value of `annotation` is, in a file's words ("a number"); None where it is no plain kind."""
    if get_origin(annotation) is Annotated:
        return _kind_text(get_args(annotation)[0])
    if get_origin(annotation) in _UNIONS:
        kinds = {_kind_text(arg) for arg in get_args(annotation) if arg is not type(None)}
        kinds = {"a number"} if kinds == {"a number", "a whole number"} else kinds  # int | float
        return kinds.pop() if len(kinds) == 1 else None
    if get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(json.dumps(value) for value in get_args(annotation))
    if _models(annotation):  # its fields named where they are few (a profile's environment has 17)
        named = _fields_at(annotation, ())
        return "an object" + (f" with {', '.join(named)}" if 0 < len(named) <= _FIELDS_LISTED else "")
    kinds = {bool: "true or false", int: "a whole number", float: "a number", str: "text in quotes"}
    origin = get_origin(annotation)
    return kinds.get(annotation) or ("a list" if origin in (list, tuple) else "an object" if origin is dict else None)


def is_trace_document(doc: Any) -> bool:
    """Whether a JSON document has a pipesim trace's top-level keys (traces/trace.py `to_chrome`'s), so that a trace
    given where another file is read (a profile, a study's results) is refused as a trace, not by the first field it
    lacks."""
    return isinstance(doc, dict) and {"traceEvents", "pipesim"} <= doc.keys()


def is_profile_document(doc: Any) -> bool:
    """Whether a JSON document has a pipesim profile's top-level keys (`is_profile_bytes`'s), and is no trace."""
    return isinstance(doc, dict) and {"schema_version", "layers"} <= doc.keys() and not is_trace_document(doc)


# `document_kind`'s names: the JSON files pipesim writes (a trace, a profile, a study's results) or reads (a
# cluster file, a stage graph), each as a refusal names one given in another's place
TRACE, PROFILE, STUDY_RESULTS = "trace", "profile", "study results file"
CLUSTER, GRAPH_FILE = "cluster file", "graph file"
SIMULATE_REPORT = "simulate report"  # what `simulate --json` prints: no command reads it back
# a cluster file's top-level keys, sim/cluster.py ClusterSpec's fields (it allows no other; this leaf may not import
# it, tests/test_file_errors.py holds the two equal): "devices" alone is no cluster file, `compare --json` writes one
CLUSTER_KEYS = frozenset({"devices", "link", "links", "overlap_comm", "contention", "collective_contention"})
GRAPH_KEYS = frozenset({"stages", "edges", "placement"})  # a stage graph's (schedules/graph.py `load_graph`'s)


@dataclass(frozen=True)
class DocumentKind:
    """How a refusal (`check_kind`) tells a user what the file given is and what to give instead."""

    reader: str  # the command that reads a file of this kind, {path} where its path goes, and what it does with it
    wanted: str  # what to give where this kind is wanted


DOCUMENT_KINDS = {
    TRACE: DocumentKind("`pipesim view {path}` draws it",
                        "a trace that `pipesim run --trace` or `pipesim simulate --trace` wrote"),
    PROFILE: DocumentKind("`pipesim simulate --profile {path}` reads it",
                          "a profile that `pipesim calibrate --out` or `pipesim estimate --out` wrote"),
    STUDY_RESULTS: DocumentKind("`pipesim study --plot-only --results {path}` draws it",
                                "the --results file `pipesim study` wrote"),
    CLUSTER: DocumentKind("`pipesim simulate --cluster {path}` reads it",
                          "a JSON file of devices and links (docs/simulate.md)"),
    GRAPH_FILE: DocumentKind("`pipesim simulate -s graphpipe --graph {path}` reads it",
                             'a JSON file of "stages", "edges" and "placement" (docs/simulate.md)'),
    SIMULATE_REPORT: DocumentKind("`pipesim simulate --json` printed it, and no command reads it back",
                                  "what `pipesim simulate --json` prints"),
}


def document_kind(doc: Any) -> str | None:
    """Which of `DOCUMENT_KINDS` a JSON document is, by its top-level keys, else None: a trace (`is_trace_document`),
    a profile (`is_profile_document`), a study's results (format_version and setting), a cluster file (devices,
    and no key outside `CLUSTER_KEYS`), simulate's --json report (results and skipped) or a stage graph (stages and
    edges, and no key outside `GRAPH_KEYS`)."""
    if is_trace_document(doc):
        return TRACE
    if is_profile_document(doc):
        return PROFILE
    if isinstance(doc, dict) and {"format_version", "setting"} <= doc.keys():
        return STUDY_RESULTS
    if isinstance(doc, dict) and "devices" in doc and doc.keys() <= CLUSTER_KEYS:
        return CLUSTER
    if isinstance(doc, dict) and doc.keys() == {"results", "skipped"} and isinstance(doc["results"], list):
        return SIMULATE_REPORT
    return GRAPH_FILE if isinstance(doc, dict) and {"stages", "edges"} <= doc.keys() <= GRAPH_KEYS else None


def check_kind(doc: Any, path: str | Path, wanted: str, error: type[Exception]) -> None:
    """Raise `error` where the JSON document at `path`, read as a `wanted` (one of `DOCUMENT_KINDS`), is a file of
    another kind: one line naming what it is, the command that reads it (its path as pasted into a shell) and what
    to give, not the first field it lacks."""
    kind = document_kind(doc)
    if kind is not None and kind != wanted:
        reader = DOCUMENT_KINDS[kind].reader.format(path=shlex.quote(str(path)))
        raise error(f"{path} is a pipesim {kind}, not a {wanted}: {reader}; give {DOCUMENT_KINDS[wanted].wanted}")


def read_document(path: str | Path, kind: str, error: type[Exception]) -> Any:
    """The JSON document at `path`, read as a `kind` (one of `DOCUMENT_KINDS`): one that cannot be read, is not
    JSON (`read_json`) or is a file of another kind (`check_kind`) raises `error` naming it as that kind."""
    doc = read_json(path, error, kind, give=DOCUMENT_KINDS[kind].wanted)
    check_kind(doc, path, kind, error)
    return doc


def validated(model: Any, doc: Any, path: str | Path, kind: str, error: type[Exception]) -> Any:
    """The pydantic `model` validated from the document at `path` (`read_document`'s); where it is not one, `error`
    naming the file as its `kind` and the first field that is wrong (`first_error`)."""
    from pydantic import ValidationError  # here, not at import: this leaf's readers of text files never need it

    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        raise error(f"{kind} {path}: {first_error(exc, model)}") from None


# `is_trace_document`'s keys as a file's bytes hold them: the "traceEvents" list and the "pipesim" header
_TRACE_KEYS = (re.compile(rb'"traceEvents"\s*:\s*\['), re.compile(rb'"pipesim"\s*:\s*\{'))
# a profile's (profiles/schema.py `Profile`'s) as they are told from other JSON (traces/trace.py `read_trace`'s)
_PROFILE_KEYS = (re.compile(rb'"schema_version"\s*:'), re.compile(rb'"layers"\s*:\s*\['))


def without_bom(data: bytes) -> bytes:
    """A file's bytes after the UTF-8 byte-order mark a Windows editor or a spreadsheet puts before what it saves."""
    return data.removeprefix(codecs.BOM_UTF8)


def _json_object_with(data: bytes, keys: tuple[re.Pattern[bytes], ...]) -> bool:
    """Whether a file's bytes are a JSON object holding `keys`, however a JSON tool laid it out (re-indented, its
    keys reordered, a byte-order mark before it), told without parsing what may be a gigabyte of events."""
    return without_bom(data).lstrip().startswith(b"{") and all(key.search(data) for key in keys)


def is_trace_bytes(data: bytes) -> bool:
    """Whether a file's bytes are a pipesim trace's: a JSON object with `is_trace_document`'s keys."""
    return _json_object_with(data, _TRACE_KEYS)


def is_profile_bytes(data: bytes) -> bool:
    """Whether a file's bytes are a pipesim profile's: a JSON object with a schema_version and layers, and not a
    trace (whose header has a schema_version too, near its top once a tool sorts its keys)."""
    return _json_object_with(data, _PROFILE_KEYS) and not is_trace_bytes(data)

"""Units, in one place: MiB and GiB are powers of two everywhere in pipesim; a count says its noun in the
singular for one.

A leaf module (it imports nothing), so both shared vocabularies may use it.
"""

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40
PIB = 1 << 50
MAX_BYTES = PIB  # any size pipesim reads larger is a typo, and would overflow the int64 memory counters
MAX_MEMORY_GIB = MAX_BYTES // GIB  # a device's memory (a cluster's, a GPU's, --memory-gb) at most: the same PiB
MIN_MEMORY_GIB = 1 / GIB  # a device's memory at least: one byte, as pipesim holds it in whole bytes (int(gib * GIB))
MAX_MS = 1e9  # about 11.6 days per op: any time pipesim reads larger is a typo, and would overflow its clock
# The most the simulator's picosecond clock and its memory counters (int64) count to, with room to spare (sim/engine.py
# refuses a run past it; a trace's op that ends later is refused as it is read)
COUNTER_LIMIT = 2**62


def count_text(number: int, noun: str) -> str:
    """`number` and `noun`, the noun plural unless the number is one ("1 mini-batch", "4 mini-batches", "1,200
    profiles", "2 weight copies"): the lines a user reads count single things too. Named as `rate_text` and
    `ms_text` are, not `counted`: pipesim's functions name a model's count `counted`, which would shadow it there."""
    plural = (noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else
              noun + ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s"))
    return f"{number:,} {noun if number == 1 else plural}"


def bytes_text(nbytes: int) -> str:
    """A size in the largest of PiB, TiB, GiB, MiB and KiB it reaches, to four significant figures, else in bytes
    ("4.135 MiB", "512 B"): calibrate's progress and its summary's link lines alike, where "4335616 bytes" was left
    to count. Up to PiB, so a sum past 10,000 GiB reads "151.7 TiB", not "1.553e+05 GiB"; a figure still past 999
    (1,023 GiB, or past 1,000 PiB) is grouped in thousands, never written with an exponent."""
    for unit, scale in (("PiB", PIB), ("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            figure = float(f"{nbytes / scale:.4g}")
            return f"{figure:,.0f} {unit}" if figure >= 1000 else f"{figure:g} {unit}"
    return f"{nbytes} B"


def number_allowed(least: float | None, most: float | None, whole: bool = True, finite: bool = False,
                   above: bool = False, below: bool = False) -> str:
    """What a number takes with its bounds grouped in thousands, "give a whole number from 1 to 1,000" ("of at least
    1" where it has no upper bound; `finite`: "give a finite number from 0 to 1,000,000,000", where nan and inf are
    refused too; `above`: `least` itself is refused, "give a finite number above 0 and at most 86,400", a time or a
    rate that 0 makes no sense of; `below`: `most` itself is refused, "give a finite number at least 0 and below 1",
    a probability that 1 makes no sense of): the one wording of the command line's range refusals (cli.py
    `_allowed`), of pipesim's own (workload/sizes.py `size_refusal`, commands/common.py `finite_from` and
    `parse_numbers`) and of the benchmarks'."""
    def bound(value: float) -> str:
        return f"{int(value):,}" if float(value).is_integer() else f"{value:,.10g}"

    if (above and least is not None) or (below and most is not None):
        lower = f"{'above' if above else 'at least'} {bound(least)}" if least is not None else ""
        upper = f"{'below' if below else 'at most'} {bound(most)}" if most is not None else ""
        bounds = " " + " and ".join(filter(None, (lower, upper)))
    else:
        bounds = (f" from {bound(least)} to {bound(most)}" if least is not None and most is not None else
                  f" of at least {bound(least)}" if least is not None else
                  f" of at most {bound(most)}" if most is not None else "")
    return f"give {'a whole number' if whole else 'a finite number' if finite else 'a number'}{bounds}"


def given_text(given: str) -> str:
    """A value as a refusal quotes it: a whole number grouped in thousands ("got 5,000", as pipesim's own refusals
    write one), another number as typed ("got 1.5"), a word quoted ("got 'x'"). Here, not in cli.py, so that the
    benchmarks' parsers (benchmarks/one_line_parser.py) quote a value as the command line does, without typer."""
    if given.lstrip("-").isdecimal():
        return f"{int(given):,}"
    try:
        float(given)
    except ValueError:
        return repr(given)
    return given


def float_text(value: float) -> str:
    """A float a parser has read, quoted as it was most likely typed, where the text typed is gone (typer hands a
    float option's callback the float, not the text): "1e30", not f"{value:g}"'s "1e+30", which no user typed;
    "0.1234567891" in full, not "0.123457"; a whole number grouped as given_text groups one ("86,401"), up to where a
    float holds every whole number (2**53), past which int() would show digits nobody typed."""
    if value.is_integer() and abs(value) <= 2 ** 53:
        return given_text(str(int(value)))
    mantissa, _, exponent = repr(value).partition("e")  # repr: the shortest text that reads back as `value`
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def value_text(value: object) -> str:
    """A value as a refusal quotes it where no text typed is at hand (a parameter read from a file, a trace's
    recorded params): a float as float_text quotes it, anything else as given_text quotes its text ("1,000",
    "'two'")."""
    return float_text(value) if isinstance(value, float) else given_text(str(value))


def memory_gib_refusal(memory_gib: float) -> str | None:
    """What a device's memory in GiB (--memory-gb, a cluster file's or a catalogue part's memory_gib) must be, where
    `memory_gib` is not it (None where it is): pipesim holds it as whole bytes, so less than one byte was a 0-byte cap
    that nothing fits. The least is said in bytes: in GiB it is 9.31e-10, which read as a figure with no unit."""
    if MIN_MEMORY_GIB <= memory_gib <= MAX_MEMORY_GIB:
        return None
    return f"give GiB per device, from 1 byte to {MAX_MEMORY_GIB:,} GiB (got {float_text(memory_gib)})"


def checked_memory_gib(memory_gib: float) -> float:
    """`memory_gib`, or a ValueError saying memory_gib_refusal: the validator of every schema's memory_gib (a
    cluster file's device, a catalogue part), so a file's field is refused as the flag is."""
    if refusal := memory_gib_refusal(memory_gib):
        raise ValueError(refusal)
    return memory_gib


def whole_number(text: str, most: int) -> int | None:
    """`text` as a whole number written in decimal digits alone, from 0 to `most`; None where it is not one (int()
    reads '+1', ' 1' and '1_0', and isdigit passes '²', which int() refuses) or is more than `most`, told by its
    count of digits before int() reads it (int() refuses a string of 4,301 digits, both with a traceback)."""
    digits = text.lstrip("0")
    if not text.isdecimal() or len(digits) > len(str(most)):
        return None
    number = int(digits or 0)
    return number if number <= most else None


def rounds_text(rounds: int) -> str:
    """How a run's mini-batch's micro-batches run where in several flushes (`--rounds`), as the labels write it
    after m: " in 2 rounds"; "" in one."""
    return f" in {rounds:,} rounds" if rounds > 1 else ""


def degree_text(letter: str, degree: int) -> str:
    """One degree of a run's shape as every label writes it, "p=1,024", "P=1,000": grouped in thousands as a count is
    (count_text), so a view's, tune's, a sweep's, simulate's and an estimate's labels read a large figure alike (the
    table's "avgpipe (P=1,000)" grouped, while the others, each written by hand, read "p=1024")."""
    return f"{letter}={degree:,}"

"""units.py's text: sizes as calibrate's progress and summary print them, and the range and value every refusal
writes (number_allowed, given_text)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.units import GIB, MIB, bytes_text, float_text, given_text, number_allowed


def test_a_size_reads_in_the_largest_unit_it_reaches_at_four_figures():
    """A stage's gradients past 10,000 MiB read "1.234e+04 MiB" while MiB was the largest unit."""
    assert [bytes_text(n) for n in (512, 4335616, 12345 * MIB, GIB)] == ["512 B", "4.135 MiB", "12.06 GiB", "1 GiB"]


def test_a_size_past_ten_thousand_gib_reads_as_a_plain_number_in_tib_or_pib():
    """155,300 GiB read "1.553e+05 GiB" while GiB was the largest unit; a size past the largest unit is grouped."""
    assert [bytes_text(n) for n in (155_300 * GIB, 1023 * GIB, 3 << 50, 12_345 << 50)] == \
        ["151.7 TiB", "1,023 GiB", "3 PiB", "12,340 PiB"]


@pytest.mark.parametrize("least, most, kind, said", [
    (1, 10_000, {}, "give a whole number from 1 to 10,000"),
    (1, None, {}, "give a whole number of at least 1"),
    (None, 4096, {}, "give a whole number of at most 4,096"),
    (None, None, {}, "give a whole number"),
    (0, 1e9, dict(whole=False, finite=True), "give a finite number from 0 to 1,000,000,000"),
    (0.5, 2.25, dict(whole=False), "give a number from 0.5 to 2.25"),
    (0, 86_400, dict(whole=False, finite=True, above=True), "give a finite number above 0 and at most 86,400"),
    (0, None, dict(whole=False, finite=True, above=True), "give a finite number above 0"),
    (None, 7, dict(above=True), "give a whole number of at most 7"),  # `above` bounds `least`; none here
    (0, 1, dict(whole=False, finite=True, below=True), "give a finite number at least 0 and below 1"),
    (0, 1, dict(whole=False, finite=True, above=True, below=True), "give a finite number above 0 and below 1"),
    (None, 1_000, dict(below=True), "give a whole number below 1,000"),
    (3, None, dict(below=True), "give a whole number of at least 3"),  # `below` bounds `most`; none here
])
def test_a_range_reads_in_one_sentence_form_with_its_bounds_grouped(least, most, kind, said):
    """Every bound pipesim refuses a number by: "of at most" had no test, and an exclusive least had no form (run's
    --lr/--timeout and the benchmarks' seconds wrote "above 0" by hand), nor an exclusive most (--dropout wrote
    "below 1" by hand)."""
    assert number_allowed(least, most, **kind) == said


@pytest.mark.parametrize("typed, said", [("5000", "5,000"), ("-1200", "-1,200"), ("0", "0"), ("1.5", "1.5"),
                                         ("1e30", "1e30"), ("nan", "nan"), ("x", "'x'"), ("", "''"),
                                         ("1,000", "'1,000'")])
def test_a_value_is_quoted_grouped_as_typed_or_as_a_word(typed, said):
    """A whole number grouped as pipesim groups its own; any other number exactly as typed; anything else quoted."""
    assert given_text(typed) == said


@given(st.integers(min_value=-10**30, max_value=10**30))
def test_a_whole_number_typed_reads_back_as_the_same_number(number):
    """Grouping loses nothing: the commas taken out, the quoted value is the number typed."""
    assert int(given_text(str(number)).replace(",", "")) == number


@pytest.mark.parametrize("value, said", [(1e30, "1e30"), (1e-05, "1e-5"), (-2.5e-300, "-2.5e-300"), (0.0, "0"),
                                         (86401.0, "86,401"), (0.1234567891, "0.1234567891"), (float("inf"), "inf"),
                                         (float("nan"), "nan"), (2.0 ** 60, "1.152921504606847e18")])
def test_a_parsed_float_is_quoted_as_it_was_typed(value, said):
    """typer hands a float flag's check the float: f"{value:g}" quoted a typed 1e30 as "1e+30", 0.1234567891 as
    "0.123457"."""
    assert float_text(value) == said


@given(st.floats(allow_nan=False))
def test_a_quoted_float_reads_back_as_the_same_float(value):
    """The quote loses nothing: read back (commas out), it is the float the parser read."""
    assert float(float_text(value).replace(",", "")) == value

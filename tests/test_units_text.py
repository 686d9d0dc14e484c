"""units.py's sizes as text: what calibrate's progress and summary print."""

from pipesim.units import GIB, MIB, bytes_text


def test_a_size_reads_in_the_largest_unit_it_reaches_at_four_figures():
    """A stage's gradients past 10,000 MiB read "1.234e+04 MiB" while MiB was the largest unit."""
    assert [bytes_text(n) for n in (512, 4335616, 12345 * MIB, GIB)] == ["512 B", "4.135 MiB", "12.06 GiB", "1 GiB"]


def test_a_size_past_ten_thousand_gib_reads_as_a_plain_number_in_tib_or_pib():
    """155,300 GiB read "1.553e+05 GiB" while GiB was the largest unit; a size past the largest unit is grouped."""
    assert [bytes_text(n) for n in (155_300 * GIB, 1023 * GIB, 3 << 50, 12_345 << 50)] == \
        ["151.7 TiB", "1,023 GiB", "3 PiB", "12,340 PiB"]

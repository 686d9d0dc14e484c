"""units.py's sizes as text: what calibrate's progress and summary print."""

from pipesim.units import GIB, MIB, bytes_text


def test_a_size_reads_in_the_largest_unit_it_reaches_at_four_figures():
    """A stage's gradients past 10,000 MiB read "1.234e+04 MiB" while MiB was the largest unit."""
    assert [bytes_text(n) for n in (512, 4335616, 12345 * MIB, GIB)] == ["512 B", "4.135 MiB", "12.06 GiB", "1 GiB"]

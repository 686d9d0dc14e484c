"""The refusal of a value outside a fixed few, or of names not among them, is written once (choices.py `choose_from`,
`unknown_names`): every reader says it alike, and no module writes either sentence again by hand."""

from __future__ import annotations

import re
from pathlib import Path

from pipesim.choices import choose_from, nearest_text, unknown_names

ROOT = Path(__file__).resolve().parents[1]


def test_the_refusal_names_the_flag_each_choice_and_the_value_as_given():
    assert choose_from("--zero", (0, 1, 2, 3), 4) == "--zero: choose from 0, 1, 2, 3 (got 4)"
    assert choose_from("{ema}", ("gpu", "cpu"), "") == "{ema}: choose from gpu, cpu (got '')"


def test_unknown_names_are_each_named_as_given_before_the_choices():
    assert unknown_names("--schedule", ["nope", "x"], ("gpipe", "1f1b")) == (
        "--schedule: unknown 'nope', 'x'; choose from gpipe, 1f1b")


def test_a_misspelt_name_is_answered_with_the_nearest_choice_case_and_underscores_aside():
    """A misspelt schedule was answered with all 16 names alone, the one meant easy to miss among them: each
    unknown name now says the choice nearest it, where one is near (the rule --gpu's refusal uses too)."""
    schedules = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
    assert unknown_names("--schedule", ["1fb1", "nope", "ZB_H1"], schedules) == (
        "--schedule: unknown '1fb1' (did you mean '1f1b'?), 'nope', 'ZB_H1' (did you mean 'zb-h1'?); choose from "
        "gpipe, 1f1b, interleaved-1f1b, zb-h1")
    assert nearest_text("h10-sxm", ["h100-sxm", "h200"]) == " (did you mean 'h100-sxm'?)"
    assert nearest_text(4, ["4", "8"]) == ""  # a number in a grid's axis of names: no name is near it


def test_a_name_that_begins_known_ones_is_answered_with_them():
    """A new user's `--gpu h100` was answered "did you mean 'h800'?" (the closest spelling), where the parts meant are
    h100-sxm and h100-pcie; `-s interleaved` likewise names interleaved-1f1b."""
    gpus = ("a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm", "h100-pcie", "h200", "h800")
    assert nearest_text("h100", gpus) == " (did you mean 'h100-sxm' or 'h100-pcie'?)"
    assert nearest_text("A100", gpus) == " (did you mean 'a100-sxm-40gb' or 'a100-sxm-80gb'?)"
    assert nearest_text("zb", ("zb-h1", "zb-h2", "zb-v")) == " (did you mean 'zb-h1', 'zb-h2' or 'zb-v'?)"
    assert nearest_text("interleaved", ("1f1b", "interleaved-1f1b")) == " (did you mean 'interleaved-1f1b'?)"
    assert nearest_text("", gpus) == ""  # an empty name begins every one: none is meant


def test_no_module_writes_either_sentence_by_hand():
    folders = [folder for folder in ROOT.iterdir() if folder.is_dir() and folder.name != "tests"
               and not folder.name.startswith(".")]  # the package's own, not the virtual environment's
    modules = [*ROOT.glob("*.py"), *(path for folder in folders for path in folder.rglob("*.py"))]
    written = [f"{path.relative_to(ROOT)}:{number}" for path in modules if path.name != "choices.py"
               for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
               if re.search(r"choose from \{.*\(got |unknown \{.*; choose from", line)]
    assert written == []

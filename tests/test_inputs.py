"""core.inputs.digits_int: the one way surfaces read a number from text."""

import pytest

from core.inputs import digits_int


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("42", 42),
        ("9" * 18, int("9" * 18)),  # fits a bigint
        ("9" * 19, None),
        ("", None),
        ("-1", None),
        (" 1", None),
        ("1.0", None),
        ("\u00b2", None),  # "²".isdigit() is true; int() refuses it
        ("\u0663", None),  # Arabic-Indic three: int() would read 3
        ("12\n", None),
    ],
)
def test_digits_int(text, expected):
    assert digits_int(text) == expected


def test_digits_int_bound():
    assert digits_int("99999", max_digits=5) == 99999
    assert digits_int("100000", max_digits=5) is None

"""core.inputs: digits_int, the one way surfaces read a number from text, and the JSON
depth check every JSON body passes before it is parsed."""

import pytest

from core.inputs import InputError, digits_int, json_depth_check, json_loads_safe


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


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ('{"a": [1, {"b": "x]}\\"["}]}', 3),  # brackets inside strings and escapes do not count
        ('["\\\\", {"k": "\\u005b"}]', 2),
        ('[[["', 3),  # an unterminated string: what stands before it counts
    ],
)
def test_json_depth_counts_brackets_outside_strings(text, depth):
    json_depth_check(text, max_depth=depth)
    with pytest.raises(InputError, match="nested deeper"):
        json_depth_check(text, max_depth=depth - 1)


def test_a_body_of_escaped_quotes_is_refused_in_one_pass():
    """An opening quote, then 200 KB of escaped quotes, is no string, and each of them once
    made the check scan to the end again: minutes for one body. It is refused as JSON."""
    body = '"' + '\\"' * 100_000
    json_depth_check(body)
    with pytest.raises(InputError, match="not valid JSON"):
        json_loads_safe(body)

"""The text pipeline every corpus reader shares: parse a line, normalise it, judge the pair."""

import pytest

from mtrain.data.corpus import BadLine, read_line, usable


def test_a_line_is_parsed_then_normalised():
    pair = read_line(1, "\ufeff我們\tHello  world\n".encode(), None, False, "zh", "en")
    assert pair == ("我们", "Hello world")
    assert read_line(2, "1\tHi\t2\t嗨\n".encode(), None, True, "zh", "en") == ("嗨", "Hi")
    assert read_line(3, "一\n".encode(), b"one\r\n", False, "zh", "en") == ("一", "one")


def test_a_blank_line_of_a_tsv_is_none_and_an_empty_side_is_kept_but_unusable():
    assert read_line(1, b"  \n", None, False, "zh", "en") is None
    assert read_line(1, b"\n", b"\n", False, "zh", "en") == ("", "")  # two files: a pair
    pair = read_line(1, b"\tHi\n", None, False, "zh", "en")
    assert pair == ("", "Hi") and not usable(*pair) and usable("一", "one")


def test_a_bad_line_is_bad_wherever_it_is_read():
    with pytest.raises(BadLine, match="expected 2 or 4 tab-separated columns, got 3"):
        read_line(1, b"a\tb\tc\n", None, False, "zh", "en")
    with pytest.raises(BadLine, match="not valid UTF-8"):
        read_line(1, b"\xff\tb\n", None, False, "zh", "en")

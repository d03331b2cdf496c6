"""Text normalisation shared by corpus preparation, training and translation."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _t2s():
    import opencc  # imported lazily: only Chinese text needs it

    return opencc.OpenCC("t2s")


def normalize(text: str, lang: str) -> str:
    """Collapse whitespace and, for Chinese, convert traditional characters to simplified."""
    text = " ".join(text.split())
    if lang == "zh" and text:
        text = _t2s().convert(text)
    return text

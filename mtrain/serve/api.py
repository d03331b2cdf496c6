"""Requests as the API takes them: JSON bodies checked field by field into typed records."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mtrain.core.config import MAX_ALPHA, MAX_BEAM, DecodeConfig


class ApiError(Exception):
    """A request the server refuses: an HTTP status and a one-line message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_body: int = 1 << 20  # bytes
    max_sentences: int = 256
    max_beam: int = MAX_BEAM  # the bound of every command, the API and the config
    max_top_k: int = 20


@dataclass(frozen=True)
class SearchOptions:
    """How to search; requests with equal options can be decoded in one batch."""

    beam: int
    alpha: float
    nbest: int = 1


@dataclass
class TranslateRequest:
    texts: list[str]
    options: SearchOptions


@dataclass
class ExplainRequest:
    text: str
    options: SearchOptions
    top_k: int  # next pieces shown per greedy step


EXAMPLE = 'send a JSON object such as {"text": "我是谁"}'

# Integers longer than this are kept as their digit count: no field takes one, and Python
# refuses to parse more than 4,300 digits.
MAX_DIGITS = 40


@dataclass(frozen=True)
class Huge:
    """An integer of the body too long to be any field's value."""

    digits: int

    def __str__(self) -> str:
        return f"a {self.digits}-digit integer"


def _parse_int(text: str) -> int | Huge:
    return int(text) if len(text) <= MAX_DIGITS else Huge(len(text.lstrip("-")))


def whole_number(text: str | None, key: str, high: int) -> int:
    """A query parameter or header read as a whole number in [0, high]: ASCII digits only (not
    `²` or `٣`, which `isdigit()` passes and `int()` may not), never more than MAX_DIGITS."""
    if text is None or not re.fullmatch(f"[0-9]{{1,{MAX_DIGITS}}}", text):
        raise ApiError(422, f"{key!r} must be a whole number, not {_shown(text)}")
    value = int(text)
    if value > high:
        raise ApiError(422, f"{key!r} must be between 0 and {high}, not {_shown(value)}")
    return value


def parse_body(body: bytes) -> dict[str, Any]:
    """The JSON object a request body holds, or an ApiError saying what is wrong with it."""
    if not body.strip():
        raise ApiError(400, f"empty request body; {EXAMPLE}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ApiError(400, "invalid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise ApiError(422, f"the body must be a JSON object; {EXAMPLE}")
    return value


def _check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ApiError(422, f"unknown field {unknown[0]!r}; expected {', '.join(allowed)}")
    if "text" not in body:
        raise ApiError(422, f"missing field 'text'; {EXAMPLE}")


def _shown(value: Any) -> str:
    """A client's value in a one-line message: JSON, cut short."""
    text = str(value) if isinstance(value, Huge) else json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if type(value) is not int:  # bool is an int subclass: refused too
        raise ApiError(422, f"{key!r} must be an integer, not {_shown(value)}")
    if not low <= value <= high:
        raise ApiError(422, f"{key!r} must be between {low} and {high}, not {_shown(value)}")
    return value


def _sentence(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ApiError(422, f"{where} must be a string, not {_shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate such as "\ud800": JSON allows it, UTF-8 not
        raise ApiError(400, f"{where} is not valid UTF-8 (a lone surrogate)") from None
    return value


def _options(body: dict[str, Any], decode: DecodeConfig, limits: Limits) -> SearchOptions:
    beam = _integer(body, "beam", decode.beam_size, 1, limits.max_beam)
    nbest = _integer(body, "nbest", 1, 1, limits.max_beam)
    if nbest > beam:
        raise ApiError(422, f"nbest {nbest} needs beam {nbest} or more")
    alpha = body.get("alpha", decode.alpha)
    if type(alpha) not in (int, float) or not 0 <= alpha <= MAX_ALPHA:  # NaN and inf too
        raise ApiError(
            422, f"'alpha' must be a finite number from 0 to {MAX_ALPHA:g}, not {_shown(alpha)}"
        )
    return SearchOptions(beam, float(alpha), nbest)


def translate_request(
    body: dict[str, Any], decode: DecodeConfig, limits: Limits
) -> TranslateRequest:
    """POST /translate: {"text": a sentence or a list of them, "beam", "alpha", "nbest"}."""
    _check_fields(body, ("text", "beam", "alpha", "nbest"))
    text = body["text"]
    if isinstance(text, list):
        if not text:
            raise ApiError(422, "'text' is an empty list; give at least one sentence")
        if len(text) > limits.max_sentences:
            raise ApiError(
                413, f"too many sentences: {len(text)}; at most {limits.max_sentences} a request"
            )
        texts = [_sentence(t, f"'text' item {i}") for i, t in enumerate(text)]
    else:
        texts = [_sentence(text, "'text'")]
    return TranslateRequest(texts, _options(body, decode, limits))


def explain_request(body: dict[str, Any], decode: DecodeConfig, limits: Limits) -> ExplainRequest:
    """POST /explain: {"text": one sentence, "beam", "alpha", "nbest", "top_k"}."""
    _check_fields(body, ("text", "beam", "alpha", "nbest", "top_k"))
    if isinstance(body["text"], list):
        raise ApiError(422, "'text' must be one sentence: /explain shows one search at a time")
    text = _sentence(body["text"], "'text'")
    top_k = _integer(body, "top_k", 5, 1, limits.max_top_k)
    return ExplainRequest(text, _options(body, decode, limits), top_k)

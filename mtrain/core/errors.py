"""The base of mtrain's own errors, and the error of options that do not go together."""

from __future__ import annotations


class MtrainError(Exception):
    """An error of the user's making (input, files, config, options, devices): its message is
    the one line `mtrain` prints before it exits with status 2."""


class OptionError(MtrainError, ValueError):
    """Options that do not go together, e.g. an n-best list longer than the beam."""

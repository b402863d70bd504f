"""Errors jspec raises for bad input. All derive from `JspecError` (a `ValueError`)."""

from __future__ import annotations


class JspecError(ValueError):
    """Bad input to jspec: the message says what is wrong and how to fix it."""


class ModelLoadError(JspecError):
    """A model or drafter could not be found, read or understood."""

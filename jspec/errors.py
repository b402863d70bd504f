"""Errors jspec raises for bad input. All derive from `JspecError` (a `ValueError`)."""

from __future__ import annotations


class JspecError(ValueError):
    """Bad input to jspec: the message says what is wrong and how to fix it."""


class ModelLoadError(JspecError):
    """A model or drafter could not be found, read or understood."""


class PlainDecodingWarning(UserWarning):
    """A drafter was given but jspec decodes plainly: its measured record (`jspec.defaults`,
    its `settings.max_batch`) says plain decoding is faster for this batch on this machine class. The
    output distribution is the same; pass `length=` to speculate anyway."""

"""The one exception type for user mistakes.

Library code raises :class:`SinklabError` when the *input* is wrong (a missing file, a size out of
range, a model that cannot be supported). The CLI prints its message as one line and exits 2.
Messages say what is wrong and what to do instead.
"""

from __future__ import annotations


class SinklabError(Exception):
    """A user mistake, reported as one sentence: what is wrong, and the fix."""


def check_positive(sizes: dict[str, object]) -> None:
    """The one check of sizes that count something: each value of ``sizes`` (name -> value) an
    ``int`` >= 1 (a ``bool`` is not a size). Raises :class:`SinklabError` naming the first bad
    one: ``window must be a positive integer, got 0``."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SinklabError(f"{name} must be a positive integer, got {value!r}")

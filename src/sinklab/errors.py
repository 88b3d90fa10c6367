"""The one exception type for user mistakes.

Library code raises :class:`SinklabError` when the *input* is wrong (a missing file, a size out of
range, a model that cannot be supported). The CLI prints its message as one line and exits 2.
Messages say what is wrong and what to do instead.
"""

from __future__ import annotations


class SinklabError(Exception):
    """A user mistake, reported as one sentence: what is wrong, and the fix."""

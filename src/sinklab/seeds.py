"""Random seeds: the range torch accepts, and seeds derived from a user's seed.

``torch.manual_seed`` takes any integer in ``-2**63 .. 2**64 - 1``; outside it fails with
"Overflow when unpacking long long". :func:`check_seed` refuses such a ``--seed`` in one line, and
:func:`derive_seed` keeps seeds computed from a user's (one stream per step, per length) inside
that range, so every accepted seed works everywhere. Seeds below ``2**64`` that earlier versions
accepted derive the same values as before.
"""

from __future__ import annotations

from sinklab.errors import SinklabError

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


def check_seed(seed: int, option: str = "--seed") -> int:
    """``seed`` when torch accepts it; else a one-line error naming ``option``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
        raise SinklabError(
            f"{option} {seed} is outside the seeds torch accepts ({SEED_MIN}..{SEED_MAX}); "
            "pass a smaller one"
        )
    return seed


def derive_seed(seed: int, scale: int, offset: int) -> int:
    """``seed * scale + offset`` wrapped into ``0 .. 2**64 - 1`` (a valid torch seed)."""
    return (seed * scale + offset) % 2**64

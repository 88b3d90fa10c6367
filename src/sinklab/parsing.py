"""Parsing option values, one rule each: comma-separated lists (an empty item is refused: it is
usually a typo), integer and number lists, and values quoted short in error messages. Used by the
commands and by the report's ``--set KEY=VALUE``, so ``--texts a,,b`` and
``--set probe_lengths=128,,256`` are refused alike."""

from __future__ import annotations

from sinklab.errors import SinklabError


def short(value: str, n: int = 60) -> str:
    """``value`` for an error message: quoted, and cut in the middle when long."""
    return repr(value if len(value) <= n else f"{value[: n - 15]}...{value[-12:]}")


def split_list(value: str, name: str, example: str) -> list[str]:
    """'a, b' -> ['a', 'b']: the one rule for every comma-separated option (an empty item, as in
    'a,' or 'a,,b', is refused: it is usually a typo)."""
    parts = [p.strip() for p in value.split(",")]
    if not any(parts):
        raise SinklabError(f"{name} is empty; pass comma-separated values, e.g. {example}")
    if not all(parts):
        raise SinklabError(
            f"{name} {short(value)} has an empty item; separate values with single commas, "
            f"e.g. {example}"
        )
    return parts


def parse_int_list(value: str | None, name: str) -> list[int] | None:
    """'128,512,2048' -> [128, 512, 2048]; a clear error for anything else."""
    if value is None:
        return None
    parts = split_list(value, name, "128,512")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise SinklabError(f"{name} must be comma-separated integers, got {short(value)}") from None


def parse_float_list(value: str | None, name: str, example: str) -> tuple[float, ...] | None:
    """'0,0.5,1' -> (0.0, 0.5, 1.0); ranges are checked by the configs."""
    if value is None:
        return None
    try:
        return tuple(float(p) for p in split_list(value, name, example))
    except ValueError:
        raise SinklabError(
            f"{name} must be comma-separated numbers, e.g. {example}; got {short(value)}"
        ) from None


def as_option(value: object) -> str:
    """A config value as a command line writes it: a tuple or list comma-separated (what
    :func:`split_list` and :func:`parse_int_list` read back), anything else as ``str``."""
    return ",".join(map(str, value)) if isinstance(value, tuple | list) else str(value)

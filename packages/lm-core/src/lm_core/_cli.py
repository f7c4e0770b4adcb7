"""How a config's checks name a field in their errors: as the field, or as its CLI flag."""

from __future__ import annotations

from collections.abc import Mapping


def as_field(name: str) -> str:
    """`name` as is: a config's own checks name its fields."""
    return name


def as_flag(name: str, renamed: Mapping[str, str] | None = None) -> str:
    """The flag of field `name`: `renamed[name]`, else `--name-with-dashes`."""
    return (renamed or {}).get(name) or "--" + name.replace("_", "-")

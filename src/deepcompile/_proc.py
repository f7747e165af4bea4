"""What Linux's /proc says of memory: one reader for its `Name:   value kB` files."""

from __future__ import annotations


def kib_field(path: str, field: str) -> int | None:
    """`field` of a /proc file of `Name:   value kB` lines (`/proc/meminfo`,
    `/proc/self/status`), in bytes; None off Linux or where the file has no such field."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None

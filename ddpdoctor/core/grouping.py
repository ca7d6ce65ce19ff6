"""Grouping ranks by a value, and saying the groups in one line.

On 512 ranks a list of values per rank is unreadable; `ranks 0-507 on H100 80GB;
ranks 508-511 on H100 94GB` names the odd ones at a glance.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Hashable, Mapping

from ddpdoctor.core.findings import rank_ranges


def _key(value: Any) -> Hashable:
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else value


def shown(value: Any) -> str:
    """A fact as users read it: `{"unknown": reason}` is "unknown", None is "none"."""
    if isinstance(value, dict) and set(value) == {"unknown"}:
        return "unknown"
    if value is None:
        return "none"
    return str(value)


def group_ranks(values: Mapping[int, Any]) -> list[tuple[Any, list[int]]]:
    """(value, ranks) pairs, the largest group first; ties by lowest rank."""
    groups: dict[Hashable, tuple[Any, list[int]]] = {}
    for rank in sorted(values):
        key = _key(values[rank])
        groups.setdefault(key, (values[rank], []))[1].append(rank)
    return sorted(groups.values(), key=lambda g: (-len(g[1]), g[1][0]))


def describe_groups(groups: list[tuple[Any, list[int]]], show: Callable[[Any], str] = shown,
                    word: str = "on", plural_word: str = "") -> str:
    """`ranks 0-3,6 on A100 80GB; ranks 4-5 on A100 40GB` (word "has": "ranks 0-1 have Ring")."""
    parts = []
    for value, ranks in groups:
        noun, verb = ("rank", word) if len(ranks) == 1 else ("ranks", plural_word or word)
        parts.append(f"{noun} {rank_ranges(ranks)} {verb} {show(value)}")
    return "; ".join(parts)


def minority(groups: list[tuple[Any, list[int]]]) -> list[int]:
    """The ranks outside the one largest group; every rank when no group is largest."""
    if len(groups) < 2:
        return []
    if len(groups[0][1]) == len(groups[1][1]):
        return sorted(r for _, ranks in groups for r in ranks)
    return sorted(r for _, ranks in groups[1:] for r in ranks)

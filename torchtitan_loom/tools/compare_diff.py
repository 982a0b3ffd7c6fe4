"""What each compared group really changed: the configuration its runs resolved (run.json's
``resolved``: every section and the model arguments; config.toml for runs written before it was
recorded) against the reference group's (the first), and a warning for two groups whose runs of
the same seed logged the same losses at every step (they trained the same thing, whatever their
names say). No torch import."""

from __future__ import annotations

from itertools import combinations
from typing import Any

from torchtitan_loom.components.runtime.resolved import training_part
from torchtitan_loom.tools.compare_runs import Group

MAX_SHOWN = 6  # keys named per group; more are counted


def _trained(g: Group) -> dict[str, Any] | None:
    """What the group's (first) run trained: its resolved record less the keys of where and how
    it was kept or watched (components/runtime/resolved.training_part)."""
    runs = g.used or g.runs
    return training_part(runs[0].resolved) if runs else None


def changes(groups: list[Group]) -> dict[str, dict[str, tuple[Any, Any]]]:
    """Group name -> {key: (its value, the reference group's)} for every group but the first."""
    if not groups or _trained(groups[0]) is None:
        return {}
    ref = _trained(groups[0]) or {}
    out: dict[str, dict[str, tuple[Any, Any]]] = {}
    for g in groups[1:]:
        cfg = _trained(g) or {}
        keys = sorted(k for k in {*ref, *cfg} if cfg.get(k) != ref.get(k))
        out[g.name] = {k: (cfg.get(k), ref.get(k)) for k in keys}
    return out


def changes_table(groups: list[Group], diff: dict[str, dict[str, tuple[Any, Any]]]) -> list[str]:
    """| group | what it changes against the first group | (markdown), of ``changes(groups)``."""
    if not diff:
        return []
    rows = []
    for name, keys in diff.items():
        shown = [f"{k} = {v!r} (not {r!r})" for k, (v, r) in list(keys.items())[:MAX_SHOWN]]
        more = len(keys) - len(shown)
        text = "; ".join(shown) + (f"; and {more} more" if more > 0 else "")
        rows.append(f"| {name} | {text or 'nothing: the same configuration'} |")
    return [f"| group | what it changes against {groups[0].name} |", "|---|---|", *rows]


def _losses_by_seed(g: Group) -> dict[int, tuple[tuple[int, float], ...]]:
    return {r.seed: tuple(r.losses) for r in g.used if r.seed is not None and r.losses}


def same_losses(groups: list[Group]) -> list[str]:
    """One warning per pair of groups whose finished runs of every shared seed logged identical
    losses at every logged step."""
    warnings = []
    for a, b in combinations(groups, 2):
        la, lb = _losses_by_seed(a), _losses_by_seed(b)
        shared = sorted(set(la) & set(lb))
        if shared and all(la[s] == lb[s] for s in shared):
            seeds = ", ".join(map(str, shared))
            warnings.append(
                f"groups {a.name} and {b.name} logged the same loss at every step (seed "
                f"{seeds}): they trained the same configuration; check what each changes"
            )
    return warnings

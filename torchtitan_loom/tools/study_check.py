"""What a study checks before it launches anything, beyond each run's config being valid:

- the study file's values are read as a trainer TOML reads them (``"model.num_loops" = "none"``
  and ``"checkpoint.enable" = "off"`` are refused there, so here too), and the command line each
  run is launched with resolves to exactly those values (strings, booleans, numbers in exponent
  form, negative numbers, lists: ``round_trip_problems``);
- every variant trains something no other variant, nor the base (the config file with the
  [study] overrides), trains: the configuration each resolves to (every section and the model
  arguments, as run.json records it) is compared, the keys that only say where a run lives or
  how it is watched left out. A variant with no overrides is the base itself, declared so (the
  reference of a comparison); one whose overrides change nothing is refused.
No torch import."""

from __future__ import annotations

from typing import Any

from torchtitan_loom.components.runtime.resolved import (
    flat_sections,
    resolved_config,
    training_part,
)
from torchtitan_loom.config.fields import overridden_args
from torchtitan_loom.config.manager import ConfigError, load_config
from torchtitan_loom.config.schema import JobConfig


def typed_config(args: list[str], values: dict[str, Any], where: str) -> JobConfig:
    """The config of ``args`` (the config file, the run's folder and seed) with ``values`` read as
    a TOML file's (ConfigError naming ``where``)."""
    try:
        return load_config(args, file_values=list(values.items()), where=where)
    except ConfigError as exc:
        raise ConfigError("\n".join(f"{where}: {line}" for line in str(exc).splitlines())) from None


def round_trip_problems(typed: JobConfig, launched: JobConfig, where: str) -> list[str]:
    """Keys whose value the launched command line does not reproduce (one line each)."""
    a, b = flat_sections(typed.to_dict()), flat_sections(launched.to_dict())
    return [
        f"{where}: {k} = {a.get(k)!r} reads back as {b.get(k)!r} from the command line the run "
        f"is launched with; write it so that it survives (e.g. a list item without a comma)"
        for k in sorted({*a, *b})
        if a.get(k) != b.get(k)
    ]


def training_config(cfg: JobConfig) -> dict[str, Any] | None:
    """What the run trains (None when its model does not resolve: the config check says why)."""
    try:
        return training_part(resolved_config(cfg, overridden_args(cfg)))
    except (ValueError, KeyError, TypeError):
        return None


def alike_problems(base: JobConfig, variants: dict[str, tuple[JobConfig, bool]]) -> list[str]:
    """One line per variant that trains what the base (when it has overrides: ``variants`` maps
    a name to its config and whether it has any) or an earlier variant trains."""
    errors: list[str] = []
    seen: dict[str, str] = {}  # training config (as text) -> the first variant with it
    base_key = repr(sorted((training_config(base) or {}).items()))
    for name, (cfg, overrides) in variants.items():
        trained = training_config(cfg)
        if trained is None:
            continue
        key = repr(sorted(trained.items()))
        if key in seen:
            errors.append(
                f"[variants.{name}] resolves to the same configuration as [variants.{seen[key]}]: "
                f"both would train the same model on the same data; make one differ or remove it"
            )
        elif overrides and key == base_key:
            errors.append(
                f"[variants.{name}] resolves to the same configuration as the base (the config "
                f"file with the [study] overrides): its overrides change nothing; an empty "
                f"[variants.{name}] declares the base as a variant"
            )
        seen.setdefault(key, name)
    return errors

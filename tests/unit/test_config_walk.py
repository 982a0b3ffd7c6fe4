"""The schema walk: every field of every section, given a non-default value (each choice of an
enum, both booleans, a number other than the default, a list), on the command line (both forms),
in a TOML file and through every TorchTitan alias that reaches it, resolves to exactly that value,
the same from every source; for [model], the model arguments the trainer builds hold it too. Then
the resolved config.toml reads back as itself, and the study's command-line strings of typed
values (exponent floats, negative numbers, lists, booleans, text) read back as those values.

It walks the schema itself, so a field added tomorrow is walked too; the expected value of each
case is the value given (not a recorded result)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from torchtitan_loom.config import load_config, to_toml
from torchtitan_loom.config.aliases import ALIASES
from torchtitan_loom.config.fields import overridden_args
from torchtitan_loom.config.manager import _split_optional, section_fields, section_types
from torchtitan_loom.config.schema import JobConfig
from torchtitan_loom.protocols import model_args_of
from torchtitan_loom.tools.study_file import cli_value

# Not walked: job.config_file is the path of the file the other sources are read from (its own
# tests); tp, cp and pp have no legal value but 1, their default (refusals tested in
# test_config_torchtitan.py).
_NOT_WALKED = {"job.config_file", "parallelism.tp", "parallelism.cp", "parallelism.pp"}


def _flavor_default(key: str) -> typing.Any:
    flavors, _ = model_args_of("loom")
    return getattr(flavors["debug"], key)


def _values(sec: str, key: str, tp: typing.Any, field: dataclasses.Field) -> list[typing.Any]:
    """Non-default values of one field: every choice, both booleans, a number, a list."""
    inner, _ = _split_optional(tp)
    default = field.default if field.default is not dataclasses.MISSING else None
    if sec == "model" and default is None and key not in ("name", "flavor"):
        default = _flavor_default(key)
    choices = field.metadata.get("choices")
    if sec == "model" and key == "flavor":
        return list(model_args_of("loom")[0])
    if sec == "model" and key == "name":
        return ["loom"]
    if choices:
        return list(choices)
    if inner is bool:
        return [True, False]
    if inner is int:
        return [default + 1 if default != -1 else 3, -2 if default != -2 else -3]
    if inner is float:
        base = default if default else 0.25
        return [base * 2 + 0.125, -base, 1e-05]
    if inner is str:
        return ["walk_value", "none", "a b"]
    if typing.get_origin(inner) is list:
        return [["alpha", "beta"], ["none"]]
    raise AssertionError(f"{sec}.{key}: no walk values for {tp!r}")


def _cases() -> list[tuple[str, str, typing.Any]]:
    out = []
    for sec, cls in section_types(JobConfig()).items():
        for key, (tp, f) in section_fields(cls).items():
            if f"{sec}.{key}" in _NOT_WALKED:
                continue
            out += [(sec, key, v) for v in _values(sec, key, tp, f)]
    return out


CASES = _cases()


def _toml(v: typing.Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def _spellings(sec: str, key: str) -> list[str]:
    return [f"{sec}.{key}"] + [
        tt for tt, a in ALIASES.items() if a.key == f"{sec}.{key}" and not a.per_training_step
    ]


def _sources(dotted: str, value: typing.Any, tmp_path) -> dict[str, list[str]]:
    text = cli_value(dotted, value)
    sec, key = dotted.rsplit(".", 1)
    path = tmp_path / f"walk_{abs(hash((dotted, repr(value))))}.toml"
    path.write_text(f"[{sec}]\n{key} = {_toml(value)}\n")
    return {
        "cli": [f"--{dotted}", text]
        if text and not text.startswith("-")
        else [f"--{dotted}={text}"],
        "cli=": [f"--{dotted}={text}"],
        "toml": ["--job.config_file", str(path)],
    }


def _same(a: typing.Any, b: typing.Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("sec,key,value", CASES, ids=[f"{s}.{k}={v!r}" for s, k, v in CASES])
def test_every_source_and_alias_gives_the_value(sec, key, value, tmp_path):
    for dotted in _spellings(sec, key):
        alias = ALIASES.get(dotted)
        given = value
        if alias is not None and alias.values:  # a TorchTitan value spelled its way
            given = next((tt for tt, ours in alias.values.items() if ours == value), value)
        if alias is not None and alias.refuse and given in alias.refuse:
            continue  # the alias does not reach this value (its own word means another thing)
        for where, argv in _sources(dotted, given, tmp_path).items():
            cfg = load_config(argv)
            got = getattr(getattr(cfg, sec), key)
            assert _same(got, value), f"{dotted} via {where} ({argv}): got {got!r}, not {value!r}"
            if sec == "model" and key not in ("name", "flavor"):
                built = getattr(overridden_args(cfg), key)
                assert _same(built, value), f"{dotted} via {where}: the model args hold {built!r}"
    # The run folder's config.toml reads back as the same config.
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    read, ran = load_config(["--job.config_file", str(path)]).to_dict(), cfg.to_dict()
    for d in (read, ran):  # config.toml records the file it came from as a comment
        d["job"].pop("config_file")
    assert read == ran, f"{sec}.{key} = {value!r}: config.toml reads back otherwise"


def test_the_walk_covers_every_key_and_every_choice():
    covered = {(s, k) for s, k, _ in CASES}
    for sec, cls in section_types(JobConfig()).items():
        for key, (_, f) in section_fields(cls).items():
            if f"{sec}.{key}" not in _NOT_WALKED:
                assert (sec, key) in covered
            for choice in f.metadata.get("choices") or ():
                assert (sec, key, choice) in CASES


@pytest.mark.parametrize(
    "key,value",
    [
        ("optimizer.lr", 1e-05),
        ("optimizer.lr", 2.5e-3),
        ("optimizer.weight_decay", -0.0),
        ("optimizer.eps", 1e-300),
        ("training.steps", 7),
        ("training.seed", 2**63 - 1),
        ("checkpoint.load_step", -1),
        ("model.ffn_branch_rms", "none"),
        ("model.embed_inject_mode", "none"),
        ("model.cycle_residual_scale", False),
        ("job.description", "-h"),
        ("job.description", "--x"),
        ("job.description", 'two\nlines\tand a "quote"'),
        ("float8.filter_fqns", ["output", "router"]),
        ("eval.downstream_tasks", []),
    ],
)
def test_a_study_value_survives_its_command_line(key, value, tmp_path):
    """The study launches each run with cli_value strings: they must read back as the typed value
    (and as the same value a TOML file gives)."""
    from torchtitan_loom.tools.study_check import round_trip_problems, typed_config
    from torchtitan_loom.tools.study_file import override_args

    launched = load_config(override_args({key: value}))
    typed = typed_config([], {key: value}, "the study file")
    assert round_trip_problems(typed, launched, "w") == []
    sec, name = key.split(".")
    assert _same(getattr(getattr(launched, sec), name), value)

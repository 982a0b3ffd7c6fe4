"""How a config field is declared and documented, and the generated [model] section.

``opt`` declares a field of a section dataclass: its default and its one help text (metadata
``doc``, printed by ``--help``), and optionally ``choices``: the valid string values, always the
tuple the implementing module defines, never a copy. The ``[model]`` keys are the chosen model's:
``model_section`` generates them from the args dataclass of its registered TrainSpec, with that
dataclass's own field docs (``attribute_docs``) and the spec's choices; no model is imported here.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import field
from typing import Any, cast

from torchtitan_loom.protocols import model_args_of


def opt(default: Any, doc: str, *, choices: tuple[str, ...] | None = None):
    """A documented config field (``default`` may be a list; it is copied per instance)."""
    meta = {"doc": doc, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (its one documentation)."""
    # the source of a class is its class statement
    body = cast(ast.ClassDef, ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]).body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


# Model args that are not [model] keys: the init seed is training.seed (one seed per run).
_NOT_MODEL_KEYS = ("init_seed",)
DEFAULT_MODEL = "loom"


def flavor_problem(name: str, flavor: str) -> str | None:
    """The line an unknown flavor of the spec ``name`` gets; None for a known one, or for an
    unknown name (model.name's own problem). Torch-free: early.py asks it before torch."""
    try:
        flavors, _ = model_args_of(name)
    except ValueError:
        return None
    if flavor in flavors:
        return None
    return f"model.flavor: unknown flavor '{flavor}' of '{name}'; valid: {', '.join(flavors)}"


def model_section(name: str) -> type:
    """[model] of the spec ``name``: name, flavor, then one optional override per field of its args
    dataclass (None keeps the flavor's value). Reads the flavors without importing the model
    (protocols.model_args_of): ValueError for an unknown name."""
    flavors, arg_choices = model_args_of(name)
    choices = tuple((k, tuple(v)) for k, v in arg_choices.items())
    args_cls: Any = type(next(iter(flavors.values())))
    return _model_section(name, args_cls, tuple(flavors), choices)


# Memoised on everything the class is made of (a spec registered anew under the same name with
# other args gives another key): reading the docs parses the source, ~0.1 s a call, and every
# config load needs the section twice.
@functools.lru_cache(maxsize=16)
def _model_section(
    name: str,
    args_cls: Any,
    flavors: tuple[str, ...],
    choices: tuple[tuple[str, tuple[str, ...]], ...],
) -> type:
    arg_choices = dict(choices)
    docs, hints = attribute_docs(args_cls), typing.get_type_hints(args_cls)
    fields = [
        ("name", str, opt(name, "Registered TrainSpec name; the keys below are its model's.")),
        (
            "flavor",
            str,
            opt(next(iter(flavors)), f"Size preset of the spec ({name}: {', '.join(flavors)})."),
        ),
    ]
    for f in dataclasses.fields(args_cls):
        if f.name not in _NOT_MODEL_KEYS:
            fields.append(
                (
                    f.name,
                    hints[f.name] | None,
                    opt(None, docs.get(f.name, ""), choices=arg_choices.get(f.name)),
                )
            )
    # Equal by values (each call makes a new class, so the dataclass __eq__'s class check would fail).
    return dataclasses.make_dataclass(
        "Model", fields, eq=False, namespace={"__eq__": _same_section}
    )


def _same_section(a: Any, b: Any) -> bool:
    return (
        type(b).__name__ == "Model"
        and dataclasses.is_dataclass(b)
        and not isinstance(b, type)  # for asdict: a class never passes the name check above
        and dataclasses.asdict(a) == dataclasses.asdict(b)
    )


def default_model() -> Any:
    """The [model] section of the default model, all keys unset."""
    return model_section(DEFAULT_MODEL)()


def overridden_args(cfg: Any) -> Any:
    """The flavor's model arguments with every set [model] key applied and the run's init seed,
    torch-free and not yet validated (validate.resolve_model_args checks them). ValueError for an
    unknown model name, KeyError for an unknown flavor."""
    flavors, _ = model_args_of(cfg.model.name)
    overrides = {
        k: v
        for k, v in dataclasses.asdict(cfg.model).items()
        if k not in ("name", "flavor") and v is not None
    }
    overrides["init_seed"] = cfg.training.seed
    return dataclasses.replace(flavors[cfg.model.flavor], **overrides)

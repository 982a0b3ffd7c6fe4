"""The answers a command line gets before torch is imported (``python -m torchtitan_loom.train``
calls ``answer_early`` first): ``--help``, and the config's own problems — unknown keys, types,
choices, ranges that load_config checks, an unknown flavor (the flavor table is torch-free) — and
a run folder that holds this very run, finished (run_folder.relaunch_errors reads its run.json;
a different run is named with the config's other problems, after torch), one line each, exit 2. Importing torch takes seconds on a cold start (tens on
a loaded machine); a typo is answered in a fraction of one. A command line that passes goes on to
the full checks (the model, the layout, the data, the run folder) after torch.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.messages import shorten_line
from torchtitan_loom.components.runtime.run_folder import relaunch_errors
from torchtitan_loom.config.fields import flavor_problem
from torchtitan_loom.config.gates import gated_problems
from torchtitan_loom.config.help import help_requested, help_text
from torchtitan_loom.config.manager import ConfigError, load_config

# What a command line without --job.config_file runs, ./run_train.sh's and `python -m
# torchtitan_loom.train`'s alike: the debug model on the bundled corpus (in a checkout of the
# repository; an installed wheel without train_configs/ runs the schema's defaults).
DEFAULT_PRESET = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "train_configs",
    "debug_model.toml",
)


def with_default_preset(argv: list[str]) -> list[str]:
    """``argv`` with ``--job.config_file DEFAULT_PRESET`` in front when it names no config file."""
    named = any(a.split("=", 1)[0] in ("--job.config_file", "--job.config-file") for a in argv)
    if named or not os.path.isfile(DEFAULT_PRESET):
        return argv
    return ["--job.config_file", DEFAULT_PRESET, *argv]


def _flavor(cfg: Any) -> list[str]:
    """An unknown model.flavor, checked from the torch-free flavor table ([] when fine or no
    config was built)."""
    problem = None if cfg is None else flavor_problem(cfg.model.name, cfg.model.flavor)
    return [problem] if problem else []


def _gated(cfg: Any) -> list[str]:
    """Keys given with their feature off (gates.py; [] when no config was built)."""
    return [] if cfg is None else gated_problems(cfg)[0]


def answer_early(argv: list[str]) -> None:
    """Print --help, or the config's problems and exit 2; return when there is nothing to say."""
    wanted, rest_of_argv = help_requested(argv)
    if wanted:
        print(help_text(rest_of_argv))
        sys.exit(exit_codes.OK)
    rest = [a for a in argv if a != "--check-config" and not a.startswith("--check-config=")]
    try:
        cfg = load_config(rest)
    except ConfigError as exc:  # the flavor too, so that one run names every problem it can
        lines = str(exc).splitlines() + _flavor(exc.partial) + _gated(exc.partial)
    else:  # keys whose feature is off; a finished or different run in the folder: its files say so
        lines = (_flavor(cfg) + _gated(cfg)) or relaunch_errors(cfg, finished_only=True)
    for line in lines:
        print(shorten_line(f"config error: {line}"), file=sys.stderr)
    if lines:
        sys.exit(exit_codes.BAD_INPUT)

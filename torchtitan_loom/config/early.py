"""The answers a command line gets before torch is imported (``python -m torchtitan_loom.train``
calls ``answer_early`` first): ``--help``, and the config's own problems — unknown keys, types,
choices, ranges that load_config checks — one line each, exit 2. Importing torch takes seconds on a
cold start (tens on a loaded machine); a typo is answered in a fraction of one. A command line that
passes goes on to the full checks (the model, the layout, the data, the run folder) after torch.
"""

from __future__ import annotations

import os
import sys

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.messages import shorten_line
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


def answer_early(argv: list[str]) -> None:
    """Print --help, or the config's problems and exit 2; return when there is nothing to say."""
    wanted, rest_of_argv = help_requested(argv)
    if wanted:
        print(help_text(rest_of_argv))
        sys.exit(exit_codes.OK)
    rest = [a for a in argv if a != "--check-config" and not a.startswith("--check-config=")]
    try:
        load_config(rest)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(shorten_line(f"config error: {line}"), file=sys.stderr)
        sys.exit(exit_codes.BAD_INPUT)

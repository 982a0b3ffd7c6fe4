"""The command ``python -m torchtitan_loom.train [--help] [--check-config] [--section.key value ...]``
(what ./run_train.sh runs): the config's early answers before torch is imported, then
``launch.run`` with the Trainer (the trainer/ room)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from torchtitan_loom.config.early import answer_early, with_default_preset

    answer_early(with_default_preset(sys.argv[1:]))  # --help and the config's problems, pre-torch
    # `python -m`: importing torch and the trainer takes seconds on a cold start; say so first.
    print("[torchtitan_loom] importing torch and the trainer ...", flush=True)

from torchtitan_loom import launch
from torchtitan_loom.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    """One launch from ``argv`` (the process's arguments when None); its exit code."""
    return launch.run(sys.argv[1:] if argv is None else argv, Trainer)


if __name__ == "__main__":
    sys.exit(main(with_default_preset(sys.argv[1:])))  # the preset ./run_train.sh runs, too

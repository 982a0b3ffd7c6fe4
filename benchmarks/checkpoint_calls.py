"""Count the package's function calls on the way from a checkpoint path to an export and to a
built model (issue 44: one checkpoint value).

    python benchmarks/checkpoint_calls.py CKPT

CKPT: a run folder, checkpoint folder or step-N directory (train one with
``./run_train.sh --checkpoint.enable true --training.steps 2 --checkpoint.interval 2
--job.dump_folder /tmp/run``). Two paths are measured, each in this one process after a warm-up
run (so imports and first-use registration are not counted):

    export    tools.export.main([CKPT, OUT])              the command line's work
    build     found.find(CKPT).build()                    a path to a model in eval mode
              (before issue 44: tools.export.load_checkpoint_model(CKPT), measured when present)

For each: calls to functions defined in torchtitan_loom/ (module bodies excluded), those of
named functions (no comprehension, generator or lambda), those outside the model's own code
(models/), how many modules they were in, how many times the
checkpoint package (components/checkpoint/) was entered from our code outside it (a tool, this
script; not torch calling back in), how many of its modules those entries went into, and how
many of the entries were into tree.py.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import torchtitan_loom

PKG = os.path.dirname(os.path.abspath(torchtitan_loom.__file__)) + os.sep
CKPT_PKG = os.path.join(PKG, "components", "checkpoint") + os.sep
MODELS = os.path.join(PKG, "models") + os.sep


def count_calls(fn: Callable[[], Any]) -> dict[str, int]:
    """Run ``fn`` under sys.setprofile and count the package's calls (see the module doc)."""
    calls: Counter[str] = Counter()
    modules: set[str] = set()
    entered: set[str] = set()  # the checkpoint package's modules entered from outside it

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(PKG) or code.co_name == "<module>":
            return
        calls["all"] += 1
        if not code.co_name.startswith("<"):  # not a comprehension, generator or lambda
            calls["named"] += 1
        modules.add(path)
        if not path.startswith(MODELS):
            calls["outside models/"] += 1
            if not code.co_name.startswith("<"):
                calls["named outside models/"] += 1
        # Entered: called from outside it by our code (a tool, this script), not by torch or the
        # standard library calling back in (DCP's reader, a context manager).
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        ours = not any(part in caller for part in ("site-packages", "/lib/python", "<frozen"))
        outside = ours and not caller.startswith(CKPT_PKG)
        if path.startswith(CKPT_PKG) and outside:
            calls["checkpoint package entered"] += 1
            entered.add(os.path.basename(path))
        if path.endswith("checkpoint/tree.py") and outside:
            calls["tree.py entered"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {**calls, "modules": len(modules), "checkpoint modules entered": len(entered)}


def build(ckpt: str) -> Any:
    """The package's way from a checkpoint path to a model in eval mode."""
    from torchtitan_loom.tools import export

    before = getattr(export, "load_checkpoint_model", None)  # the code before issue 44
    if before is not None:
        return before(ckpt)[0]
    from torchtitan_loom.components.checkpoint import found

    return found.find(ckpt).build()


def main(argv: list[str]) -> int:
    from torchtitan_loom.tools import export

    ckpt = argv[0]
    with tempfile.TemporaryDirectory() as tmp:
        outs = iter(os.path.join(tmp, f"out{i}") for i in range(4))
        paths = {
            "export": lambda: export.main([ckpt, next(outs)]),
            "build": lambda: build(ckpt),
        }
        for name, fn in paths.items():
            fn()  # warm-up: imports and registration
            result = count_calls(fn)
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in sorted(result.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The LOOM model package: its args and flavors (args.py, torch-free), the model (model.py), and
the "loom" TrainSpec (infra/spec.py, registered on the first protocols.get_train_spec("loom")).

The names below import their module on first use (PEP 562), so reading the flavors never imports
torch: the config checks a command line before torch is imported.
"""

import importlib

from torchtitan_loom.models.loom.args import FIELD_CHOICES, LoomModelArgs, loom_flavors

_LAZY = {
    "LoomTransformer": "torchtitan_loom.models.loom.model",
    "parallelize_loom": "torchtitan_loom.models.loom.infra.parallelize",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FIELD_CHOICES", "LoomModelArgs", "LoomTransformer", "loom_flavors", "parallelize_loom"]

"""Bundled models. Each is named in BUNDLED with two modules: its args (``FLAVORS``, the size
presets, and ``FIELD_CHOICES``; torch-free, so the config reads them before torch is imported) and
the module that registers its TrainSpec when imported (protocols.get_train_spec imports it on the
first lookup)."""

BUNDLED = {"loom": ("torchtitan_loom.models.loom.args", "torchtitan_loom.models.loom.infra.spec")}

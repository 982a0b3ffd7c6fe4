"""How LOOM is laid out over devices: its parallelize function, expert parallelism, the config and
layout rules, and the dry run's cost model of a layout (the math stays in models/loom/, which never
imports this package; these modules import the math modules, never the models.loom package itself)."""

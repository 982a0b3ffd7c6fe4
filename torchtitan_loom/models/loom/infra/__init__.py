"""How LOOM is laid out over devices: its parallelize function and expert parallelism (the math stays in models/loom/)."""

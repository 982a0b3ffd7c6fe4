"""The float8 recipes [float8] accepts, without torch (the config reads them before torch is
imported; float8.py implements them)."""

DENSE_RECIPES = ("tensorwise", "rowwise")
EXPERT_RECIPES = ("auto", "fp8_rowwise", "mxfp8")

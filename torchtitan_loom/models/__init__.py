"""Bundled models; importing this package registers their train specs ("loom")."""

from torchtitan_loom.models import loom  # noqa: F401  (registers the "loom" spec)

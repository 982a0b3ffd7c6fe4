"""The optimizer, the lr schedule, and the guards on a step (spike guard, divergence stop)."""

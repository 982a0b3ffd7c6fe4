"""The exit codes of every entry point (the trainer and the tools), in one place."""

OK = 0
"""Finished, or stopped by a signal or ``checkpoint.exit_after_step`` after a save: relaunch to resume."""
FAILED = 1
"""A checkpoint could not be written (disk full); the older checkpoints are untouched."""
BAD_INPUT = 2
"""Refused before or during the run because of what it was given: a config, data, checkpoint or run
folder error, a bad tool argument, or a divergence abort (the config needs changing, relaunching
as is would fail again)."""
INTERRUPTED = 130
"""SIGINT (Ctrl-C): the shell's convention; once = save then exit, twice = exit without saving."""
RESTART = 3
"""Under torchrun's elastic agent with restarts left (run_train.sh ``NNODES=MIN:MAX``): the world
changed under this rank (a peer was lost, or stopped without this rank being signalled). Any
non-zero code makes the agent restart its workers at the world size of the next rendezvous, which
resume from the newest complete checkpoint; 0 would make it wait for the lost node instead."""

"""The [checkpoint] section's choices and defaults that code below the config needs, without
torch (the config reads them before torch is imported; manager.py and saving.py implement
async_mode, found.py looks for a run's checkpoints in its folder)."""

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
DEFAULT_FOLDER = "checkpoint"  # checkpoint.folder's default: <job.dump_folder>/checkpoint/

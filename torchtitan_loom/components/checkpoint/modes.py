"""checkpoint.async_mode's choices, without torch (the config reads them before torch is imported;
manager.py and saving.py implement them)."""

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")

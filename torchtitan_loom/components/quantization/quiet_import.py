"""Importing torchao without the lines a user cannot act on.

torchao's first import logs one ``Failed to load …/_C_*.so`` warning per prebuilt kernel library
that does not load here (a CUDA architecture or Python ABI this machine lacks: the MXFP8 and
CUTLASS kernels), and torch logs a deprecation for the Enum torchao registers with pytree. Neither
changes what runs; the project's own float8 line says which recipe and kernels a run uses. Every
other line either library logs still shows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# (logger, text of the record dropped while torchao is first imported)
_DROPPED = (
    ("torchao", "Failed to load "),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)


class _Drop(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Inside: torchao's import-time noise above is dropped (the filters go when it ends)."""
    filters = [(logging.getLogger(name), _Drop(text)) for name, text in _DROPPED]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)

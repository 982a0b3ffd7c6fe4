"""Damage a committed checkpoint the way someone with write access could, checksums matched
(CRC-32 is no authentication), for the fallback tests (unit and 2-rank)."""

import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from torchtitan_loom.components.checkpoint import integrity


class Payload:
    """Unpickling this runs a shell command that creates ``mark``: what a planted pickle does."""

    def __init__(self, mark):
        self.mark = str(mark)

    def __reduce__(self):
        return os.system, (f"touch {self.mark}",)


def _rewrite(step_dir, md):
    with open(os.path.join(step_dir, ".metadata"), "wb") as fh:
        pickle.dump(md, fh)
    integrity.write_checksums(str(step_dir))
    assert integrity.verify(str(step_dir)) is None


def plant_entry_payload(step_dir, mark):
    """Point a non-tensor entry of ``step_dir`` at a code-running pickle appended to its .distcp
    file; the .metadata stays plain DCP metadata (only the entry's offset and length change)."""
    md = dcp.FileSystemReader(str(step_dir)).read_metadata()  # the run's own, trusted file
    fqn = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[index]
    buf = io.BytesIO()
    torch.save(Payload(mark), buf)
    with open(os.path.join(step_dir, info.relative_path), "ab") as fh:
        offset = fh.tell()
        fh.write(buf.getvalue())
    md.storage_data[index] = type(info)(info.relative_path, offset, len(buf.getvalue()))
    _rewrite(step_dir, md)
    return fqn


def plant_absurd_length(step_dir):
    """Give the first storage entry of ``step_dir`` a length of 10**15 bytes."""
    md = dcp.FileSystemReader(str(step_dir)).read_metadata()
    index = next(iter(md.storage_data))
    info = md.storage_data[index]
    md.storage_data[index] = type(info)(info.relative_path, info.offset, 10**15)
    _rewrite(step_dir, md)
    return index.fqn


def plant_zeroed_tensor(step_dir):
    """Overwrite the bytes of the first tensor entry of ``step_dir`` with zeros (sizes unchanged)."""
    md = dcp.FileSystemReader(str(step_dir)).read_metadata()
    index = next(i for i in md.storage_data if i.fqn.startswith("model."))
    info = md.storage_data[index]
    with open(os.path.join(step_dir, info.relative_path), "r+b") as fh:
        fh.seek(info.offset)
        fh.write(b"\0" * info.length)
    _rewrite(step_dir, md)
    return index.fqn

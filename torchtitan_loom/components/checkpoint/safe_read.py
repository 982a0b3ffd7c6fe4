"""Reading a DCP checkpoint without running code from it.

torch.distributed.checkpoint keeps two pickles: ``.metadata`` (read with a bare ``pickle.load``)
and every non-tensor entry in the ``.distcp`` files (read with ``torch.load(weights_only=False)``
by its default planner). A pickle can call any importable function, so either would run whatever
a planted file asks for. Every read of a checkpoint in this project goes through here instead:

    SafeReader    a FileSystemReader whose ``.metadata`` is unpickled by an allow-list of DCP's own
                  metadata types (plus torch.Size, dtypes, layouts and pathlib paths), then checked
                  field by field: data files are plain names inside the checkpoint directory
    SafePlanner   a DefaultLoadPlanner whose non-tensor entries load with ``weights_only=True``
                  (containers of numbers, strings, tensors; nothing callable)

The metadata's storage entries must also fit the data files they name (offset + length within
the file): a length that does not (checksums can be matched by anyone) would otherwise make the
reader allocate whatever it says. A file that asks for anything else raises ``UnsafeCheckpoint``;
``load`` turns any other failure of the read into ``UnreadableCheckpoint``. The resume treats both
like a corrupt checkpoint (skipped for the previous one, with one warning), the tools print one
line and exit 2. No message quotes torch's own text about loading with ``weights_only=False``:
the point is never to do that.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from torchtitan_loom.components.checkpoint import names

# What DCP's own .metadata pickles name; each is safe to construct from any arguments.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},  # dtypes, layouts and memory formats: checked by type in find_class
    "torch.serialization": {"_get_layout"},  # a lookup in torch's own layouts by name
    "pathlib": {
        "PosixPath",
        "WindowsPath",
        "PurePosixPath",
        "PureWindowsPath",
    },  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that is not plain data: it names code, or data outside its directory."""


class UnreadableCheckpoint(ValueError):
    """A checkpoint whose data could not be read (truncated, inconsistent with its metadata)."""


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """A library exception as one plain line: colour codes stripped, whitespace joined, shortened,
    and without torch's paragraphs about ``weights_only`` (its advice is to load unsafely)."""
    from torchtitan_loom.components.runtime.messages import shorten

    paragraphs = re.split(r"\n\s*\n", _ANSI.sub("", str(exc)))
    kept = [p for p in paragraphs if "weights_only" not in p and p.strip()]
    text = " ".join(" ".join(kept).split())
    return shorten(f"{type(exc).__name__}: {text}" if text else type(exc).__name__, limit)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, fh: Any, path: str) -> None:
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"{self.path}: refused: it asks for {module}.{name}, which is not one of DCP's "
            f"metadata types (a checkpoint holds data only, never code)"
        )


def _check_fields(md: Any, path: str) -> None:
    """Every field has the type DCP writes, and every data file is a plain name in the directory."""

    def bad(what: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(
            f"{path}: refused: {what} (not a file written by torch.distributed.checkpoint)"
        )

    if not isinstance(md, dcp_meta.Metadata):
        raise bad(f"holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not all(
        isinstance(k, str)
        and isinstance(v, (dcp_meta.TensorStorageMetadata, dcp_meta.BytesStorageMetadata))
        for k, v in md.state_dict_metadata.items()
    ):
        raise bad("an entry of state_dict_metadata is not tensor or bytes metadata")
    if not isinstance(md.storage_data, dict):
        raise bad("storage_data is not a mapping")
    for key, info in md.storage_data.items():
        if not isinstance(key, dcp_meta.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad("an entry of storage_data is not a MetadataIndex → _StorageInfo pair")
        rel = info.relative_path
        if (
            not isinstance(rel, str)
            or os.path.basename(rel) != rel
            or rel in ("", ".", "..")
            or "\\" in rel
        ):
            raise bad(f"data file {rel!r} is not a plain file name inside the checkpoint directory")
        if not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for n in (info.offset, info.length)
        ):
            raise bad(f"data file {rel!r}: offset and length are not non-negative integers")


def _check_extents(md: Any, path: str) -> None:
    """Every storage entry lies inside the data file it names (offset + length ≤ its size)."""
    folder, sizes = os.path.dirname(path), {}
    for key, info in md.storage_data.items():
        rel = info.relative_path
        if rel not in sizes:
            try:
                sizes[rel] = os.path.getsize(os.path.join(folder, rel))
            except OSError:
                raise UnsafeCheckpoint(
                    f"{path}: refused: names data file {rel!r}, which is missing"
                ) from None
        if info.offset + info.length > sizes[rel]:
            raise UnsafeCheckpoint(
                f"{path}: refused: entry {key.fqn!r} claims bytes {info.offset}..{info.offset + info.length} "
                f"of {rel}, which holds {sizes[rel]} (not a file written by torch.distributed.checkpoint)"
            )


def read_metadata_file(path: str) -> dcp_meta.Metadata:
    """The checkpoint's DCP Metadata, unpickled through the allow-list (UnsafeCheckpoint otherwise)."""
    file = os.path.join(path, names.DCP_METADATA)
    with open(file, "rb") as fh:
        try:
            md = _MetadataUnpickler(fh, file).load()
        except UnsafeCheckpoint:
            raise
        except Exception as exc:  # a damaged pickle raises anything unpickling does
            raise UnsafeCheckpoint(f"{file}: unreadable DCP metadata ({_one_line(exc)})") from None
    _check_fields(md, file)
    _check_extents(md, file)
    return md


def metadata_problem(path: str) -> str | None:
    """None when ``path``'s .metadata is plain DCP metadata, else one line saying why not."""
    try:
        read_metadata_file(path)
    except OSError as exc:
        return f"{os.path.join(path, names.DCP_METADATA)}: unreadable ({exc.strerror or exc})"
    except UnsafeCheckpoint as exc:
        return str(exc)
    return None


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata comes through the allow-list (see module doc); ``metadata``:
    the checkpoint's Metadata already read through it (found.py verified it), not read again."""

    def __init__(self, path: str, metadata: dcp_meta.Metadata | None = None) -> None:
        super().__init__(path)
        self.checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        if kwargs.get("rank") is not None:  # rank-local metadata: never written by this project
            raise UnsafeCheckpoint(f"{self.path}: per-rank metadata is not supported")
        md = self.checked if self.checked is not None else read_metadata_file(str(self.path))
        storage: dcp_meta.StorageMeta | None = getattr(md, "storage_meta", None)
        if storage is None:
            storage = md.storage_meta = dcp_meta.StorageMeta()
        storage.load_id = getattr(self, "load_id", None)
        return md


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries load with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            # Only what the entry asked for: torch's message goes on to advise weights_only=False.
            asked = re.search(r"GLOBAL ([\w.]+)", _ANSI.sub("", str(exc)))
            what = (
                f"it asks for {asked.group(1)}" if asked else "a pickle of a type that is not data"
            )
            raise UnsafeCheckpoint(
                f"entry {read_item.dest_index.fqn!r} refused: not plain data ({what})"
            ) from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _refusal(exc: BaseException) -> UnsafeCheckpoint | None:
    """The UnsafeCheckpoint inside a DCP failure (DCP wraps a rank's error in CheckpointException)."""
    if isinstance(exc, UnsafeCheckpoint):
        return exc
    if isinstance(exc, CheckpointException):
        for err in getattr(exc, "failures", {}).values():
            err = (
                err[0] if isinstance(err, tuple) and err else err
            )  # (exception, traceback) per rank
            found = _refusal(err) if isinstance(err, BaseException) else None
            if found is not None:
                return found
    cause = exc.__cause__ or exc.__context__
    return _refusal(cause) if cause is not None else None


def _first_failure(exc: BaseException) -> BaseException:
    """The first rank's own exception inside a DCP CheckpointException (else ``exc``)."""
    for err in getattr(exc, "failures", {}).values():
        err = err[0] if isinstance(err, tuple) and err else err
        if isinstance(err, BaseException):
            return err
    return exc


def load(state_dict: dict[str, Any], path: str, no_dist: bool, metadata: Any | None = None) -> None:
    """``dcp.load`` of ``path`` into ``state_dict`` in place, through SafeReader and SafePlanner.
    Raises UnsafeCheckpoint (one line naming the checkpoint) when a file is not plain data, and
    UnreadableCheckpoint when the read fails otherwise (on every rank alike: DCP gathers the
    ranks' failures). Out-of-memory is no property of the checkpoint and is raised as it is."""
    try:
        dcp.load(
            state_dict,
            storage_reader=SafeReader(path, metadata),
            planner=SafePlanner(),
            no_dist=no_dist,
        )
    except (Exception, CheckpointException) as exc:
        refused = _refusal(exc)
        if refused is not None:
            msg = str(refused)
            raise UnsafeCheckpoint(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
        first = _first_failure(exc)
        if isinstance(first, torch.OutOfMemoryError):
            raise
        raise UnreadableCheckpoint(f"{path}: unreadable ({_one_line(first)})") from None

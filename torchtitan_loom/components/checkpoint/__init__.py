"""Checkpoints on torch.distributed.checkpoint: atomic saves, snapshots, resume at any world size.

    names.py       every file name of a run folder, its checkpoint folder and a checkpoint
    found.py       one checkpoint on disk as one value: find(path), its tensors, its model
    tree.py        the folder on disk: step-N/, snapshots/, temporaries, marker, pruning, index
    state.py       what is saved (model, optimizer, RNG) and the model-compatibility checks
    safe_read.py   every read of a checkpoint: DCP's pickles admitted by an allow-list, never code
    integrity.py   checksums (CRC-32 per file), the marker's format version, finiteness checks
    resolve.py     which checkpoint a run loads; the up-front config check used by section_checks.py
    manager.py     CheckpointManager: when to save; the facade the trainer calls
    saving.py      what is saved, the sync/async write and its commit (rank 0)
    proof.py       the proof policy, pure: PROVE_STEPS healthy steps before older checkpoints go
    pruning.py     the pruning a proof allows, agreed by every rank
    loading.py     which checkpoint is resumed, the fallback past a bad one, the restore

Stop signals (what makes a run save and exit early) are components/runtime/preemption.py's.
"""

import importlib

# Imported on first use (PEP 562): the config reads modes.py before torch is imported, and these
# import torch.
_LAZY = {
    "CheckpointManager": "torchtitan_loom.components.checkpoint.manager",
    "CheckpointError": "torchtitan_loom.components.checkpoint.state",
    "load_full": "torchtitan_loom.components.checkpoint.state",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CheckpointError", "CheckpointManager", "load_full"]

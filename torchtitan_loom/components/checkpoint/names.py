"""The file names of a run folder, its checkpoint folder and each checkpoint, spelled here only
(tests/unit/test_one_owner_files.py greps the package for them). Torch-free: the config reads them.

Legend: none (no tensors here).
"""

# A run's dump folder (components/runtime/run_folder.py); CONFIG_TOML is also in every checkpoint
# and export (the resolved config that trained it).
RUN_JSON = "run.json"
CONFIG_TOML = "config.toml"
METRICS_JSONL = "metrics.jsonl"

# The checkpoint folder (tree.py): what is where, rewritten after every commit.
INDEX = "index.json"
LAYOUT_MD = "LAYOUT.md"

# One checkpoint directory (step-N/): DCP's files, then ours beside them.
DCP_METADATA = ".metadata"  # DCP's index of the state's entries (read through safe_read.py)
META_JSON = "meta.json"  # step, world size, format version, optimizer (saving.py)
MODEL_ARGS_JSON = "model_args.json"  # {"name", "flavor", "args"}; an export's adds "file", ...
CHECKSUMS = "CHECKSUMS.json"  # a CRC-32 per file (integrity.py)
MARKER = "COMPLETE"  # written last, after every rank finished: the save is committed
KEEP = "KEEP"  # placed by hand: never pruned

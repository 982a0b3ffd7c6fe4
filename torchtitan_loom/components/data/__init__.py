"""Data side: the packed-document format, row packing, the world-size-independent train loader,
the eval loader and the bundled corpus. See docs/CONTRACTS.md (Data) and LOOM_SPEC §8, §14.

    pack_format.py   the on-disk layout, open_pack (validation)
    pack_metadata.py metadata.json read safely, every field's type and range checked
    pack_arrays.py   .npy files opened safely (no pickles), the token-id scan (memoised)
    pack_error.py    PackError: one line naming the pack, the problem and what is valid
    pack_writer.py   PackWriter: documents → pack (used by tools/pack_build.py and the bundled corpus)
    rows.py          records → rows of S+1 slots → batch tensors
    loaders.py       build_train_loader (StatefulDataLoader), build_eval_loader
    bundled.py       bundled_corpus_path: the synthetic corpus, built on first use
"""

from torchtitan_loom.components.data.bundled import bundled_corpus_path, default_cache_dir
from torchtitan_loom.components.data.loaders import (
    EvalLoader,
    TrainLoader,
    build_eval_loader,
    build_train_loader,
)
from torchtitan_loom.components.data.pack_format import Pack, PackError, open_pack
from torchtitan_loom.components.data.pack_writer import PackWriter
from torchtitan_loom.data_contract import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "EvalLoader",
    "Pack",
    "PackError",
    "PackWriter",
    "TrainLoader",
    "build_eval_loader",
    "build_train_loader",
    "bundled_corpus_path",
    "default_cache_dir",
    "open_pack",
]

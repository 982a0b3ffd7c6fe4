"""Config checks that look at the filesystem: the run folder can be written, the pack
opens and fits the model, the bundled corpus can serve the configured sequence length and be
built. Each returns one line per problem (key, path, what is valid); validate.py collects them
before any process group exists."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any

# Free space a launch needs for its run files (run.json, config.toml, the first metrics rows and
# event files); a disk with less is full for a run. Checkpoints check their own size when saved.
MIN_FREE_BYTES = 1 << 20
_PROBE = b"\0" * 4096


def writable_dir_problem(path: str, min_free: int = MIN_FREE_BYTES) -> str | None:
    """Why a directory could not be created (or written) at ``path``, else None. Probes with a
    real temporary file holding a few KiB, fsynced: permission bits do not tell for root or
    read-only mounts, and an empty file is still created on a full disk or an exhausted quota."""
    probe_dir = os.path.abspath(path)
    while not os.path.exists(probe_dir):
        parent = os.path.dirname(probe_dir)
        if parent == probe_dir:
            break
        probe_dir = parent
    if not os.path.isdir(probe_dir):
        return f"'{probe_dir}' is a file, so no directory can be made there"
    what = "is not writable" if probe_dir == os.path.abspath(path) else "cannot be created"
    try:
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".write-probe-") as fh:
            fh.write(_PROBE)
            fh.flush()
            os.fsync(fh.fileno())
        st = os.statvfs(probe_dir)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{what}: the disk is full ({exc.strerror} in '{probe_dir}'); free some space"
        return f"{what} ({exc.strerror or exc} in '{probe_dir}')"
    free = st.f_bavail * st.f_frsize
    if free < min_free:
        return (
            f"{what}: the disk is full ({free // 1024} KiB free in '{probe_dir}', a run needs at "
            f"least {min_free >> 20} MiB); free some space"
        )
    return None


def folder_errors(cfg: Any) -> list[str]:
    """job.dump_folder (and the cache of the bundled corpus when it must be built) writable."""
    errors = []
    problem = writable_dir_problem(cfg.job.dump_folder)
    if problem:
        errors.append(
            f"job.dump_folder = '{cfg.job.dump_folder}': {problem}; choose a writable folder"
        )
    links = link_errors(cfg)
    return errors + ([links] if links else [])


def link_errors(cfg: Any) -> str | None:
    """One line naming the symbolic links planted where the run writes (run files, checkpoint
    names), else None: a run never writes, renames or removes through a link."""
    from torchtitan_loom.components.checkpoint import tree
    from torchtitan_loom.components.runtime import run_folder

    folders = [cfg.metrics.tb_folder] if cfg.metrics.enable_tensorboard else []
    folders += [cfg.profiling.save_traces_folder] if cfg.profiling.enable_profiling else []
    links = run_folder.planted_links(cfg.job.dump_folder, folders)
    if cfg.checkpoint.enable:
        links += tree.planted_links(os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder))
    if not links:
        return None
    return (
        f"job.dump_folder = '{cfg.job.dump_folder}': symbolic links where the run writes: {', '.join(links)}; "
        f"remove them (a run never writes, renames or removes through a link)"
    )


def bundled_errors(cfg: Any) -> list[str]:
    """data.path empty: the bundled corpus must serve training.seq_len and, unless already built,
    its cache directory must be writable."""
    if cfg.data.path:
        return []
    from torchtitan_loom.components.data import synthetic_corpus as sc
    from torchtitan_loom.components.data.bundled import default_cache_dir

    errors = []
    if cfg.training.seq_len > sc.MAX_SEQ_LEN - 1:
        errors.append(
            f"training.seq_len = {cfg.training.seq_len}: the bundled corpus (data.path empty) holds "
            f"records of {sc.MAX_SEQ_LEN} tokens, so seq_len must be ≤ {sc.MAX_SEQ_LEN - 1}; pass "
            f"--data.path with a pack of longer records (python -m torchtitan_loom.tools.pack)"
        )
    root = cfg.data.cache_dir or str(default_cache_dir())
    if not os.path.isfile(os.path.join(root, sc.CORPUS_NAME, "metadata.json")):
        problem = writable_dir_problem(root)
        if problem:
            key = (
                "data.cache_dir"
                if cfg.data.cache_dir
                else "data.cache_dir ($TORCHTITAN_LOOM_CACHE)"
            )
            errors.append(
                f"{key} = '{root}': {problem}; the bundled corpus is built there on first use"
            )
    return errors


def pack_errors(path: str, key: str, cfg: Any, args: Any) -> list[str]:
    """The pack at ``path`` opens (no truncated or missing file) and fits the model's vocabulary."""
    from torchtitan_loom.components.data.pack_format import PackError, open_pack, read_metadata

    try:
        meta = read_metadata(Path(path))
        info = meta["tokenizer_info"]
        top = max(int(meta.get("max_token_id", -1)), int(info["eos_token_id"]))
        if top >= args.vocab_size:
            return [
                f"{key} = '{path}': the pack's token ids reach {top} (tokenizer {info.get('name_or_path')!r}, "
                f"{info['vocab_size']} ids) but model.flavor '{cfg.model.flavor}' has vocab_size "
                f"{args.vocab_size}; set --model.vocab_size (at least {top + 1}, a multiple of 256 by "
                f"LOOM_SPEC §8.2) or re-pack with a smaller tokenizer"
            ]
        open_pack(path, seq_len=cfg.training.seq_len, vocab_size=args.vocab_size)
    except PackError as exc:
        return [f"{key}: {exc}"]
    except OSError as exc:
        return [f"{key} = '{path}': unreadable ({exc})"]
    return []

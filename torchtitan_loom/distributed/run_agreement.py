"""What the ranks of one launch agree on before anything is written (issue 34): that they run the
same job, and that they see one dump folder.

- One job, one run: every rank's config (its TOML, so the dump folder with it) must be rank 0's.
  Two jobs given one rendezvous id merge into one process group; without this check they train
  as one job and each writes its checkpoint shards into its own folder.
- One folder: every rank writes its own checkpoint files into job.dump_folder and rank 0 commits
  them, so with checkpoints on every rank must see the folder rank 0 sees. Rank 0 writes a probe
  file there with a token only this launch knows; every rank reads it back. A node-local disk
  mounted at the same path fails here, at the start, instead of committing checkpoints that lack a
  rank's shards.

``run_problem`` is a collective (every rank calls it, once, right after the process group forms)
and returns the same answer on every rank: None, or the one line to stop with.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import Any

import torch.distributed as dist

from torchtitan_loom.distributed.utils import broadcast_object

PROBE_PREFIX = ".shared-probe-"


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_problem(cfg: Any, config_toml: str, rank: int, run_id: str) -> str | None:
    """None when every rank runs rank 0's config and (with checkpoints on) sees rank 0's dump
    folder; else one line naming the first rank that does not (the same line on every rank)."""
    host = socket.gethostname()
    digest = hashlib.sha256(config_toml.encode()).hexdigest()[:16]
    seen = _gather((host, digest))
    for r, (h, d) in enumerate(seen):
        if d != seen[0][1]:
            return (
                f"rank {r} (host {h}) was started with another config than rank 0 (host "
                f"{seen[0][0]}): two jobs joined one rendezvous (RDZV_ID / MASTER_PORT shared?); "
                "give each job its own rendezvous id and port, and start every node with the "
                "same command"
            )
    if not cfg.checkpoint.enable:
        return None
    folder = cfg.job.dump_folder
    probe = os.path.join(folder, PROBE_PREFIX + run_id)
    token = f"{run_id}:{host}:{os.getpid()}"
    written = None
    if rank == 0:
        try:
            with open(probe, "x") as fh:  # x: a planted file of that name is not written through
                fh.write(token)
            written = token
        except OSError as exc:
            written = f"error: {exc.strerror or exc}"
    written = broadcast_object(written)
    try:
        with open(probe, "rb") as fh:
            found = fh.read(256).decode(errors="replace") == written
    except OSError:
        found = False
    answers = _gather((host, found))
    if rank == 0:
        try:
            os.remove(probe)
        except OSError:
            pass
    if written is not None and written.startswith("error:"):
        return (
            f"job.dump_folder = '{folder}': rank 0 cannot write a probe file there ({written[7:]})"
        )
    for r, (h, ok) in enumerate(answers):
        if not ok:
            return (
                f"job.dump_folder = '{folder}': rank {r} (host {h}) does not see the file rank 0 "
                f"(host {answers[0][0]}) wrote there; every rank writes its own checkpoint files "
                "into that folder and rank 0 commits them, so it must be one folder shared by every "
                "node (a shared file system), not a node-local disk"
            )
    return None

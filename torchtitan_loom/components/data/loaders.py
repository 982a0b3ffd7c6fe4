"""Train and eval loaders over a pack, world-size independent (LOOM_SPEC §14).

Legend: G global batch rows, W data-parallel ranks, r rank, S model sequence length.

Global batch n is rows [cursor, cursor + G) of the row plan of the current data epoch; rank r
takes rows [cursor + r·G/W, cursor + (r+1)·G/W). The position (epoch, cursor) is the same on every
rank and for every W, so it is the whole loader state. "epoch" counts passes over the data: pass
k reads training ordering `training_epochs[k mod n]` (never the holdout). When fewer than G rows
are left in a pass, they are dropped and the next pass starts at row 0.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.utils.data import IterableDataset, get_worker_info

try:
    from torchdata.stateful_dataloader import StatefulDataLoader as _BaseLoader
except (
    ImportError
):  # e.g. a GPU image without torchdata: the position below is the whole state anyway
    from torch.utils.data import DataLoader as _BaseLoader

from torchtitan_loom.components.data.pack_format import Pack, PackError, open_pack
from torchtitan_loom.components.data.rows import RowPlan, assemble_rows, plan_rows


def _check_ranks(batch_rows: int, dp_rank: int, dp_world: int, name: str) -> None:
    if dp_world < 1 or not 0 <= dp_rank < dp_world:
        raise ValueError(
            f"dp_rank {dp_rank} / dp_world {dp_world}: need dp_world ≥ 1 and 0 ≤ dp_rank < dp_world"
        )
    if batch_rows < 1 or batch_rows % dp_world:
        raise ValueError(
            f"{name} {batch_rows} must be a positive multiple of the data-parallel world "
            f"size {dp_world} (each rank takes {name} / dp_world rows)"
        )


class GlobalBatchStream(IterableDataset):
    """Yields (rank slice of global batch, (epoch, cursor) after it) forever, from a start position.

    With several loader workers, worker w of N yields steps w, w+N, ... (the loader interleaves
    them back in order); every worker computes the same positions.
    """

    def __init__(
        self, pack: Pack, seq_len: int, global_batch_rows: int, dp_rank: int, dp_world: int
    ):
        self.pack = pack
        self.seq_len = seq_len
        self.global_batch_rows = global_batch_rows
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.start = (0, 0)
        self._plan_key: int | None = None
        self._plan: RowPlan | None = None

    def row_plan(self, ordering: int) -> RowPlan:
        """Row plan of epoch directory `ordering` (only the latest one is kept in memory)."""
        if self._plan_key != ordering:
            start, length = self.pack.records(ordering)
            self._plan = plan_rows(start, length, self.seq_len + 1)
            self._plan_key = ordering
            if self._plan.num_rows < self.global_batch_rows:
                raise PackError(
                    f"pack {str(self.pack.path)!r}: epoch_{ordering} packs into {self._plan.num_rows} "
                    f"rows of {self.seq_len + 1} tokens, fewer than global_batch_rows "
                    f"{self.global_batch_rows}; use a smaller global batch or a larger corpus"
                )
        assert self._plan is not None  # set above on the first call (_plan_key starts None)
        return self._plan

    def resolve(self, epoch: int, cursor: int) -> tuple[int, int]:
        """Position of the next global batch: rolls over when fewer than G rows are left."""
        orderings = self.pack.training_epochs
        if (
            cursor + self.global_batch_rows
            > self.row_plan(orderings[epoch % len(orderings)]).num_rows
        ):
            epoch, cursor = epoch + 1, 0
            self.row_plan(orderings[epoch % len(orderings)])  # validates the new pass has ≥ G rows
        return epoch, cursor

    def rank_batch(self, epoch: int, cursor: int) -> dict[str, torch.Tensor]:
        """This rank's slice of the global batch at a resolved position."""
        plan = self.row_plan(self.pack.training_epochs[epoch % len(self.pack.training_epochs)])
        per_rank = self.global_batch_rows // self.dp_world
        lo = cursor + self.dp_rank * per_rank
        return assemble_rows(self.pack.tokens, plan, lo, lo + per_rank)

    def __iter__(self):
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        epoch, cursor = self.start
        step = 0
        while True:
            epoch, cursor = self.resolve(epoch, cursor)
            after = (epoch, cursor + self.global_batch_rows)
            if step % n_workers == worker:
                yield self.rank_batch(epoch, cursor), after
            epoch, cursor = after
            step += 1

    def __getstate__(self) -> dict:
        state = (
            self.__dict__.copy()
        )  # workers rebuild row plans themselves instead of unpickling them
        state["_plan_key"], state["_plan"] = None, None
        return state


class TrainLoader(_BaseLoader):
    """StatefulDataLoader whose state is the global position {epoch, cursor} of the next batch.

    The state is this class's own (none of the base loader's), so without torchdata the plain
    torch DataLoader serves as the base with the same batches and the same state. The position is advanced in the main process as batches are handed out, so a state taken
    after n batches resumes at batch n+1 even when workers have prefetched further. Each
    `iter(loader)` continues from the current position.
    """

    def __init__(self, stream: GlobalBatchStream, num_workers: int = 0):
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch.set_vital here
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            # Its own generator: starting an iterator draws a worker base seed, which must not
            # advance torch's global RNG (checkpointed; a resumed run starts a new iterator).
            super().__init__(
                stream, batch_size=None, num_workers=num_workers, generator=torch.Generator()
            )
        self._position = (0, 0)

    def __iter__(self):
        self.dataset.start = self._position  # read by workers when the base iterator starts them
        for batch, after in super().__iter__():
            self._position = (int(after[0]), int(after[1]))
            yield batch

    def state_dict(self) -> dict:
        """{"epoch", "cursor", "global_batch_rows", "seq_len"}: the same on every rank and any W."""
        ds = self.dataset
        return {
            "epoch": self._position[0],
            "cursor": self._position[1],
            "global_batch_rows": ds.global_batch_rows,
            "seq_len": ds.seq_len,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume at a saved position; the global batch size and seq_len must match the save."""
        ds = self.dataset
        missing = [k for k in ("epoch", "cursor") if k not in state_dict]
        if missing:
            raise ValueError(
                f"data loader state lacks {missing}; expected keys epoch, cursor, "
                f"global_batch_rows, seq_len (got {sorted(state_dict)})"
            )
        for key, mine in (("global_batch_rows", ds.global_batch_rows), ("seq_len", ds.seq_len)):
            saved = state_dict.get(key, mine)
            if int(saved) != mine:
                raise ValueError(
                    f"data loader state was saved with {key}={int(saved)} but this run uses {key}={mine}; "
                    "the saved data position is only meaningful for the same global batch rows and seq_len "
                    "(restore them, or start the data from scratch by not loading this state)"
                )
        self._position = (int(state_dict["epoch"]), int(state_dict["cursor"]))


def build_train_loader(
    path: str | Path,
    seq_len: int,
    vocab_size: int,
    global_batch_rows: int,
    dp_rank: int,
    dp_world: int,
    tokenizer_name: str | None = None,
    num_workers: int = 0,
) -> TrainLoader:
    """Training loader: yields this rank's [G/W, S] slice of each global batch, forever."""
    _check_ranks(global_batch_rows, dp_rank, dp_world, "global_batch_rows")
    pack = open_pack(path, seq_len=seq_len, vocab_size=vocab_size, tokenizer_name=tokenizer_name)
    stream = GlobalBatchStream(pack, seq_len, global_batch_rows, dp_rank, dp_world)
    stream.row_plan(
        pack.training_epochs[0]
    )  # fail now, not at the first step, if the pack is too small
    return TrainLoader(stream, num_workers=num_workers)


class EvalLoader:
    """Finite, re-iterable eval batches over one fixed epoch (rows in stored order).

    Global eval batch n is rows [n·G, (n+1)·G); the last one is padded with empty rows (labels all
    -100) so every rank yields the same number of equally shaped batches. Iteration stops at the
    end of the epoch, or after the global batch in which the count of valid labels (summed over
    all ranks) reaches `max_tokens`.
    """

    def __init__(
        self,
        pack: Pack,
        epoch: int,
        seq_len: int,
        batch_rows: int,
        dp_rank: int,
        dp_world: int,
        max_tokens: int | None = None,
    ):
        self.pack, self.epoch = pack, epoch
        self.batch_rows, self.dp_rank, self.dp_world = batch_rows, dp_rank, dp_world
        self.max_tokens = max_tokens
        self.row_plan = plan_rows(*pack.records(epoch), seq_len + 1)
        label_counts = self.row_plan.label_counts()
        self._num_batches = 0
        seen = 0
        for lo in range(0, self.row_plan.num_rows, batch_rows):
            self._num_batches += 1
            seen += int(label_counts[lo : lo + batch_rows].sum())
            if max_tokens is not None and seen >= max_tokens:
                break
        self.num_label_tokens = seen  # global valid labels over the batches this loader yields

    def __len__(self) -> int:
        return self._num_batches

    def __iter__(self):
        per_rank = self.batch_rows // self.dp_world
        for n in range(self._num_batches):
            lo = min(n * self.batch_rows + self.dp_rank * per_rank, self.row_plan.num_rows)
            hi = min(lo + per_rank, self.row_plan.num_rows)
            yield assemble_rows(self.pack.tokens, self.row_plan, lo, hi, num_rows=per_rank)


def build_eval_loader(
    path: str | Path,
    seq_len: int,
    vocab_size: int,
    batch_rows: int,
    dp_rank: int,
    dp_world: int,
    val_path: str | Path | None = None,
    max_tokens: int | None = None,
    tokenizer_name: str | None = None,
) -> EvalLoader:
    """Eval loader over the holdout epoch of `path`, or over epoch_0 of `val_path` when given."""
    _check_ranks(batch_rows, dp_rank, dp_world, "batch_rows")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens {max_tokens}: must be ≥ 1, or None to read the whole holdout")
    if val_path is not None:
        pack = open_pack(
            val_path, seq_len=seq_len, vocab_size=vocab_size, tokenizer_name=tokenizer_name
        )
        epoch = 0 if 0 in pack.epoch_dirs else min(pack.epoch_dirs)
    else:
        pack = open_pack(
            path, seq_len=seq_len, vocab_size=vocab_size, tokenizer_name=tokenizer_name
        )
        if pack.holdout_epoch is None:
            raise PackError(
                f"pack {str(path)!r} has no holdout epoch (metadata holdout_epoch is null, or no "
                "epoch_9 in a reference pack); pass a separate val_path pack, or re-pack with "
                "--holdout-tokens > 0"
            )
        epoch = pack.holdout_epoch
    return EvalLoader(pack, epoch, seq_len, batch_rows, dp_rank, dp_world, max_tokens=max_tokens)

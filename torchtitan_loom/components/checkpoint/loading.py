"""The resume path of CheckpointManager: which checkpoint is loaded, the fallback past one that
fails to verify, and the restore itself (full resume or a model-only warm start).

resolve.py ranks the candidates; here rank 0 decides, every rank gets the same answer, and a
checkpoint that fails once loading began (an unreadable file, non-finite weights) is skipped for
the next one, unless it was asked for by ``load_step`` / ``initial_load_path``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

from torchtitan_loom.components.checkpoint import found, integrity, resolve, tree
from torchtitan_loom.components.checkpoint import state as ckstate
from torchtitan_loom.components.checkpoint.manager_parts import ManagerParts
from torchtitan_loom.components.optim.choices import RECORDED_BEFORE_NAMES
from torchtitan_loom.components.runtime.messages import count


class Resumer:
    """CheckpointManager's load path over the shared parts ``p`` (it records there the loaded
    run's total steps and world size)."""

    def __init__(self, parts: ManagerParts) -> None:
        self.p = parts

    def _decide(
        self, exclude: dict[str, str]
    ) -> tuple[Any, list[tree.Entry], list[str], str | None]:
        """Rank 0 picks (and verifies) the checkpoint; every rank gets the same answer or error."""
        payload: list[Any] = [None]
        if self.p.rank == 0:
            try:
                choice, found, skipped = resolve.choose(
                    self.p.root, self.p.cfg.load_step, self.p.cfg.initial_load_path, exclude=exclude
                )
                payload = [(choice, found.incomplete, skipped, None)]
            except ValueError as exc:
                payload = [(None, [], [], str(exc))]
        if self.p._distributed:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def load(self) -> int | None:
        """Newest checkpoint that verifies (checksums, then finite weights once loaded); a failing
        one is skipped with a warning naming the file, unless it was asked for by load_step."""
        exclude: dict[str, str] = {}  # path → why it was refused once loading it began
        warned: set[str] = set()
        while True:
            choice, incomplete, skipped, error = self._decide(dict(exclude))
            if error:
                raise ckstate.CheckpointError(error)
            for line in [tree.incomplete_warning(incomplete)] + skipped:
                if line and line not in warned:  # each once, though the choice may be made again
                    warned.add(line)
                    self.p._log("warning: " + line)
            if choice is None:
                self.p._log(f"no checkpoint in {self.p.root}: starting from scratch")
                return None
            key = "initial_load_path" if choice.model_only else "load_step"
            asked = self.p.cfg.load_step >= 0 or choice.model_only  # no other one to fall back on
            self.p._log(f"loading checkpoint {choice.path} ...")
            try:
                step = self._load_choice(choice)
            except ckstate.CheckpointUnreadable as exc:  # a refused entry, a read that failed
                if asked:
                    raise ckstate.CheckpointError(f"checkpoint.{key}: {exc}; refused") from None
                exclude[choice.path] = str(exc)
                continue
            bad = integrity.model_finite(self.p.model)
            if not bad:
                break
            if asked:
                raise ckstate.CheckpointError(
                    f"checkpoint.{key}: {choice.path} holds non-finite weights "
                    f"({', '.join(bad)}); refused"
                )
            exclude[choice.path] = "refused after loading (non-finite weights)"
        if step is not None:
            self.p.proof.resumed(step)  # the steps after it prove it
        if step is not None and self.p.rank == 0:
            moved = tree.abandon_newer(self.p.root, step)
            if moved:
                self.p._log(
                    f"moved the checkpoints newer than step {step} ({', '.join(moved)}) to "
                    f"{os.path.join(self.p.root, tree.ABANDONED)}: kept, never loaded or overwritten"
                )
        return step

    def _load_choice(self, choice: resolve.LoadChoice) -> int | None:
        started = time.perf_counter()
        ck = choice.on_disk  # read and verified by resolve.choose (found.py)
        version = resolve.format_problem(ck)
        if version:  # the config check refused it up front; a Trainer built without it is not
            raise ckstate.CheckpointError(version)
        lines = resolve.compat_errors(
            ck,
            self.p.model_name,
            self.p.flavor,
            self.p.model_args,
            ckstate.model_shapes(self.p.model),
            resume=not choice.model_only,
        )
        if lines:
            raise ckstate.CheckpointError(
                resolve.explain(choice.path, choice.step, lines, resume=not choice.model_only)
            )
        saved = ck.meta
        had, have = saved.get("optimizer", RECORDED_BEFORE_NAMES), type(self.p.optimizer).__name__
        if not choice.model_only and had != have:
            raise ckstate.CheckpointError(
                f"checkpoint {choice.path} was trained with optimizer.name = {had!r}; {have!r} "
                f"cannot continue its state (one optimizer's moments are not another's): resume "
                f"with optimizer.name = {had!r}, or start {have!r} from these weights with "
                f"checkpoint.initial_load_path in a new job.dump_folder"
            )
        if choice.model_only:
            self._load_model_only(ck)
            self.p._log(
                f"warm start: model weights from {choice.path} (optimizer, schedule, data and step "
                f"start fresh) in {time.perf_counter() - started:.1f} s"
            )
            return None
        self._load_full(ck)
        self.p.loaded_total_steps = saved.get(
            "total_steps"
        )  # training.steps of the run that saved it
        ws = self.p.loaded_world_size = saved.get("world_size")
        moved = (
            f", saved at {count(ws, 'rank')}, now {self.p.world_size}"
            if ws and ws != self.p.world_size
            else ""
        )
        self.p._log(
            f"resumed from {choice.path} (step {choice.step}{moved}) "
            f"in {time.perf_counter() - started:.1f} s"
        )
        return choice.step

    def _load_model_only(self, ck: found.FoundCheckpoint) -> None:
        sd = {"model": ckstate.model_state(self.p.model)}
        ckstate.dcp_load(sd, ck.folder, no_dist=not self.p._distributed, metadata=ck.dcp_metadata)
        ckstate.set_model_state(self.p.model, sd["model"])

    def _load_full(self, ck: found.FoundCheckpoint) -> None:
        path = ck.folder
        md = ck.dcp_metadata
        keys = set(md.state_dict_metadata if md is not None else ckstate.read_metadata(path))
        opt = ckstate.OptimizerLoad(self.p.model, self.p.optimizer, keys, "optimizer.")
        sd: dict[str, Any] = {
            "model": ckstate.model_state(self.p.model),
            "optimizer": opt.template(),
        }
        for name, obj in self.p.states.items():
            # Keys a newer version added are left at their defaults (load_state_dict handles them).
            tmpl = {
                k: v
                for k, v in obj.state_dict().items()
                if f"{name}.{k}" in keys or any(x.startswith(f"{name}.{k}.") for x in keys)
            }
            if not tmpl:
                raise ckstate.CheckpointError(f"checkpoint {path} holds no '{name}' state")
            sd[name] = tmpl
        sd["rng"] = {
            k: v for k, v in ckstate.rng_state(self.p.device).items() if f"rng.{k}" in keys
        }
        ckstate.dcp_load(sd, path, no_dist=not self.p._distributed, metadata=md)
        ckstate.set_model_state(self.p.model, sd["model"])
        opt.apply(sd["optimizer"])
        for name, obj in self.p.states.items():
            try:
                obj.load_state_dict(sd[name])
            except (
                ValueError,
                KeyError,
            ) as exc:  # e.g. the data loader refuses another global batch size
                raise ckstate.CheckpointError(
                    f"checkpoint {path}: cannot restore '{name}': {exc}"
                ) from None
        # The trainer loads right before its loop, so nothing after this can advance the stream.
        ckstate.set_rng_state(sd["rng"], self.p.device)

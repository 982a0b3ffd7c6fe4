"""One checkpoint on disk as one value: where it is, which step, complete and verified or why not,
its model arguments, metadata and run config, and how to load its tensors or build its model.

``find(path)`` resolves what a user names: a run folder (the newest complete checkpoint in its
checkpoint folder: the ``checkpoint.folder`` its run.json records), a checkpoint folder, a ``step-N`` DCP
directory (any world size's, read in this one process) or an export folder of tools/export.py
(``model_args.json`` + its model file). ``at(folder)`` describes a directory already chosen
(resolve.choose, per candidate of a resume). The tools (generate, lm_eval, analyze, depth, export)
and the trainer's resume read a checkpoint through this value; the files' names are names.py's.

Verification reads every file once: the checksums (integrity.py), then DCP's ``.metadata`` through
the allow-list (safe_read.py), kept on the value so that loading the tensors does not read it
again. Importing this module imports no torch (the config's checks use resolve.py, which uses it).

Legend: tensors here are a model's state dict, by parameter name at full shape (no suffixes).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

from torchtitan_loom.components.checkpoint import integrity, names, tree
from torchtitan_loom.components.checkpoint.modes import DEFAULT_FOLDER

VERIFY = ("full", "quick", "none")  # all checksums; sizes + small files; links only


class NotACheckpoint(ValueError):
    """A path that names no usable checkpoint, or a checkpoint that cannot be read: one line,
    the path first."""


@dataclasses.dataclass(frozen=True)
class FoundCheckpoint:
    """A checkpoint directory (DCP ``step-N`` or an export folder) and what its files say."""

    folder: str
    kind: str  # "periodic" / "snapshot" (its marker says), "export", "dcp" (no marker of ours)
    step: int | None
    problem: str | None  # None: complete, its files match their checksums, its metadata plain data
    note: str | None  # a warning to say (a format-1 checkpoint loads unverified)
    model_args: dict[str, Any] | None  # model_args.json: {"name", "flavor", "args", ...}
    meta: dict[str, Any]  # meta.json ({} for an export or a checkpoint not written here)
    config_path: str | None  # its config.toml (the run's resolved config), when it has one
    dcp_metadata: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def is_export(self) -> bool:
        return self.kind == "export"

    @property
    def spec_name(self) -> str | None:
        """The TrainSpec that trained it (model_args.json's "name")."""
        return (self.model_args or {}).get("name")

    def spec(self) -> tuple[Any, Any]:
        """(TrainSpec, model args) from model_args.json; NotACheckpoint for a foreign checkpoint."""
        info = self.model_args
        if info is None:
            raise NotACheckpoint(
                f"{self.folder}: no {names.MODEL_ARGS_JSON}; only checkpoints written by "
                "torchtitan_loom can be read"
            )
        from torchtitan_loom.protocols import get_train_spec

        spec = get_train_spec(info["name"])
        flavor = info.get("flavor")
        preset = spec.model_args.get(flavor) if flavor is not None else None
        args_cls = type(preset or next(iter(spec.model_args.values())))
        known = {f.name for f in dataclasses.fields(args_cls)}
        return spec, args_cls(**{k: v for k, v in info["args"].items() if k in known})

    def tensors(self) -> dict[str, Any]:
        """The model's tensors at full shape on the CPU, as saved (an export's dtype)."""
        if self.is_export:
            return _export_tensors(self.folder, (self.model_args or {}).get("file"))
        import torch

        from torchtitan_loom.components.checkpoint.state import CheckpointError, load_full

        try:
            sd = load_full(self.folder, prefix="model.", metadata=self.dcp_metadata)
        except CheckpointError as exc:  # a refused pickle (safe_read.py) or no model entries
            raise NotACheckpoint(str(exc)) from None
        bad = sorted(k for k, v in sd.items() if not isinstance(v, torch.Tensor))
        if bad:
            raise NotACheckpoint(f"{self.folder}: non-tensor model entries {bad[:5]}")
        return sd

    def build(self, device: Any = "cpu", *, decoding: bool = False) -> Any:
        """The model in fp32 and eval mode holding these tensors. ``decoding``: with the spec's
        portable args for inference (protocols.portable_args), else with the args as trained."""
        import torch

        from torchtitan_loom.protocols import portable_args

        spec, args = self.spec()
        with torch.device("meta"):
            model = spec.model_cls(portable_args(spec, args, decoding=True) if decoding else args)
        model.to_empty(device=device)
        held = set(model.state_dict())
        if any(name not in held for name, _ in model.named_buffers()):
            with torch.no_grad():
                model.init_weights()  # a buffer no checkpoint holds: computed, not loaded
        tensors = {k: v.float() if v.is_floating_point() else v for k, v in self.tensors().items()}
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise NotACheckpoint(
                f"{self.folder}: its tensors do not fit the model: missing {sorted(missing)[:4]}, "
                f"unexpected {sorted(unexpected)[:4]}"
            )
        return model.eval()


def find(path: str, step: int | None = None, verify: str = "full") -> FoundCheckpoint:
    """The checkpoint ``path`` names (see the module doc), verified as ``verify`` says (VERIFY);
    in a run or checkpoint folder the newest complete one, or with ``step`` the one of that step.
    NotACheckpoint when there is none, its save did not finish or it fails verification."""
    ck = at(_locate(path, step), verify)
    if ck.problem:
        raise NotACheckpoint(f"{ck.folder}: checkpoint is corrupt: {ck.problem}")
    return ck


def _locate(path: str, step: int | None) -> str:
    """The checkpoint directory (DCP or export) ``path`` names, or the one a folder holds."""
    if not os.path.exists(path):
        raise NotACheckpoint(
            f"{path}: no such file or directory; pass a run folder, a step-N checkpoint "
            "directory or an export folder"
        )
    if any(
        os.path.isfile(os.path.join(path, n)) for n in (names.DCP_METADATA, names.MODEL_ARGS_JSON)
    ):
        return path
    run_root = _run_checkpoints(path)
    for root in (path, run_root):
        found = tree.scan(root) if os.path.isdir(root) else None
        entry = None if found is None else found.newest() if step is None else found.find(step)
        if entry is not None:
            return entry.path
    which = (
        "no complete step-N checkpoint" if step is None else f"no complete step-{step} checkpoint"
    )
    raise NotACheckpoint(
        f"{path}: not a checkpoint directory (no {names.DCP_METADATA}) and {which} "
        f"under it or under {run_root}{why_no_checkpoint(path)}"
    )


def _run_checkpoints(path: str) -> str:
    """The checkpoint folder of the run folder ``path``: the checkpoint.folder its run.json
    records (components/runtime/run_folder.py), the schema's default without one."""
    folder = _resolved(path).get("checkpoint.folder")
    return os.path.join(path, folder if isinstance(folder, str) and folder else DEFAULT_FOLDER)


def _resolved(path: str) -> dict[str, Any]:
    """The flat config ("section.key" -> value) the run in ``path`` ran with, by its run.json."""
    run = tree.read_json(os.path.join(path, names.RUN_JSON)) or {}
    resolved = run.get("resolved")
    return resolved if isinstance(resolved, dict) else {}


def at(folder: str, verify: str = "full") -> FoundCheckpoint:
    """The checkpoint directory ``folder`` as it is, checked as ``verify`` says (its ``problem``);
    a save that did not finish (meta.json without the marker) is NotACheckpoint."""
    info = tree.read_json(os.path.join(folder, names.MODEL_ARGS_JSON))
    config = os.path.join(folder, names.CONFIG_TOML)
    config_path = config if os.path.isfile(config) else None
    if info is not None and "file" in info:  # an export (tools/export.py): its model file
        step = info.get("step")
        problem = integrity.link_problem(folder)
        return FoundCheckpoint(folder, "export", step, problem, None, info, {}, config_path)
    if not os.path.isfile(os.path.join(folder, names.DCP_METADATA)):
        raise NotACheckpoint(
            f"{folder}: not a checkpoint directory (no {names.DCP_METADATA}) and not an export "
            f"(its {names.MODEL_ARGS_JSON} names no model file)"
        )
    meta = tree.read_json(os.path.join(folder, names.META_JSON))
    if meta is not None and not tree.is_complete(folder):
        raise NotACheckpoint(
            f"{folder}: incomplete checkpoint (no {names.MARKER} marker: its save did not finish)"
        )
    marker, problem, md = None, None, None
    if os.path.isfile(os.path.join(folder, names.MARKER)):
        marker, problem = integrity.read_marker(folder)
    if problem is None:
        problem, md = _check(folder, verify, marker)
    step = (meta or {}).get("step")
    return FoundCheckpoint(
        folder,
        str((marker or {}).get("kind") or "dcp"),
        step if isinstance(step, int) else None,
        problem,
        integrity.unverified_note(folder, marker)
        if marker is not None and verify != "none"
        else None,
        info,
        meta or {},
        config_path,
        md,
    )


def _check(folder: str, verify: str, marker: dict | None) -> tuple[str | None, Any]:
    """(why ``folder`` must not be loaded or None, its DCP Metadata when it was read). A checkpoint
    without our ``marker`` has no checksums: its metadata alone is checked."""
    problem = integrity.link_problem(folder)
    if problem or verify == "none":
        return problem, None
    if marker is not None:
        problem = integrity.verify(folder, quick=verify == "quick", marker=marker)
    if problem or not os.path.isfile(os.path.join(folder, names.DCP_METADATA)):
        return problem, None
    from torchtitan_loom.components.checkpoint import safe_read  # torch-side: with a checkpoint

    try:
        return None, safe_read.read_metadata_file(folder)
    except OSError as exc:
        return (
            f"{os.path.join(folder, names.DCP_METADATA)}: unreadable ({exc.strerror or exc})",
            None,
        )
    except safe_read.UnsafeCheckpoint as exc:
        return str(exc), None


def why_no_checkpoint(path: str) -> str:
    """What a run folder without a checkpoint says about it, and the command that gives it one
    ("" for a folder that is no run): its run.json shows checkpoints off, or the run has not
    reached a save yet."""
    import shlex

    resolved = _resolved(path)
    enabled, interval = resolved.get("checkpoint.enable"), resolved.get("checkpoint.interval")
    if not isinstance(enabled, bool) or not isinstance(interval, int):
        return ""
    if not enabled:
        folder, config = (shlex.quote(p) for p in (path, os.path.join(path, names.CONFIG_TOML)))
        return (
            f"; that run trained with checkpoint.enable = false, so it saved no weights: train it "
            f"again with them (its old files move to replaced-<run_id>/): ./run_train.sh "
            f"--job.config_file {config} --job.dump_folder {folder} --job.overwrite true "
            "--checkpoint.enable true"
        )
    run = tree.read_json(os.path.join(path, names.RUN_JSON)) or {}
    return (
        f"; that run (status {run.get('status', 'unknown')!r} at step {run.get('step', '?')}) has "
        f"not saved yet: it saves every {interval} steps and at its last step"
    )


def _export_tensors(out: str, name: Any) -> dict[str, Any]:
    """The tensors of an export's model file (``name``: a plain file name inside ``out``)."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or os.path.basename(name) != name
        or "\\" in name
    ):
        raise NotACheckpoint(
            f'{os.path.join(out, names.MODEL_ARGS_JSON)}: "file" is {name!r}; it must name a file '
            f"inside {out} (model.safetensors or model.pt)"
        )
    path = os.path.join(out, name)
    if os.path.islink(path) and os.path.dirname(os.path.realpath(path)) != os.path.realpath(out):
        raise NotACheckpoint(
            f"{path}: a symbolic link out of {out}; an export's model file must be inside it"
        )
    import torch

    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused it: the file asks for code
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "not plain tensors"
        raise NotACheckpoint(
            f"{path}: refused: not a plain state dict of tensors ({first})"
        ) from None
    except (OSError, RuntimeError, ValueError) as exc:  # missing, truncated or not a model file
        raise NotACheckpoint(
            f"{path}: unreadable model file ({type(exc).__name__}: {exc})"
        ) from None

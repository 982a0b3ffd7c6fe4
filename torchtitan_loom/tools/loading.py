"""Load a trained model for inference: the one loader behind generate, lm_eval and export --format hf.

CKPT may be a run folder (the newest complete checkpoint under it or its ``checkpoint/``), a
``step-N`` DCP directory (read in this one process, whatever world size saved it) or an export
folder of ``tools/export.py`` (``model_args.json`` + ``model.safetensors``). The model comes back
in fp32, in eval mode, with MoE capacity dropping off (a token's experts must not depend on which
other tokens share its call) and the "sdpa" attention kernel (the same math as the others).

The tokenizer is the one the training pack recorded in its ``metadata.json`` (``byte`` or a
Hugging Face ``tokenizer.json``); ``tokenizer=`` overrides it only with a tokenizer that matches.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch

from torchtitan_loom.components.checkpoint import integrity, layout, names
from torchtitan_loom.components.checkpoint.resolve import read_model_args
from torchtitan_loom.components.data import pack_tokenizer as pack_tok
from torchtitan_loom.components.data.pack_tokenizer import TokenizerError
from torchtitan_loom.components.data.tokenizer import Tokenizer
from torchtitan_loom.protocols import portable_args
from torchtitan_loom.tools.export_format import (
    ExportError,
    find_checkpoint,
    model_spec,
    read_export,
)
from torchtitan_loom.tools.input_files import LoadError, TokenizerFileError, check_tokenizer_json

__all__ = ["LoadError", "Loaded", "TokenizerFileError", "load", "load_tokenizer"]


@dataclasses.dataclass
class Loaded:
    """What the inference tools need from a checkpoint."""

    model: torch.nn.Module
    args: Any  # the model args as trained (capacity and backend as saved)
    checkpoint: str  # the resolved directory (DCP step-N or export folder)
    step: int | None
    config: Any | None  # the run's JobConfig (from config.toml), when the checkpoint has one
    pack_path: Path | None  # the training pack (holdout + tokenizer), when it can be found
    tokenizer: Tokenizer | None
    flavor: str | None = None
    name: str = "loom"


def is_export_dir(path: str) -> bool:
    info = layout.read_json(os.path.join(path, names.MODEL_ARGS_JSON))
    return info is not None and "file" in info


def resolve_checkpoint(path: str) -> str:
    """The export folder or the complete DCP directory that ``path`` names (LoadError otherwise)."""
    if not os.path.exists(path):
        raise LoadError(
            f"checkpoint {path}: no such file or directory; pass a run folder, a step-N "
            "checkpoint directory or an export folder"
        )
    if is_export_dir(path):
        linked = integrity.link_problem(path)
        if linked:  # loading never reads through a link out of the folder (a copy or not)
            raise LoadError(f"checkpoint {linked}")
        return path
    try:
        ckpt = find_checkpoint(path)
    except ExportError as exc:
        raise LoadError(f"checkpoint {exc}") from None
    linked = integrity.link_problem(ckpt)
    if linked:
        raise LoadError(f"checkpoint {linked}")
    note = integrity.unverified_note(ckpt)
    if note:
        print(f"warning: {note}", file=sys.stderr)
    return ckpt


def _build(spec: Any, args: Any, tensors: dict[str, torch.Tensor], device: str) -> torch.nn.Module:
    with torch.device("meta"):
        model = spec.model_cls(portable_args(spec, args, decoding=True))
    model.to_empty(device=device)
    tensors = {k: v.float() if torch.is_floating_point(v) else v for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise LoadError(
            f"checkpoint tensors do not fit the model: missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}"
        )
    return model.eval()


def _read_config(directory: str) -> Any | None:
    path = os.path.join(directory, names.CONFIG_TOML)
    if not os.path.isfile(path):
        return None
    from torchtitan_loom.config import ConfigError, load_config

    try:
        return load_config(["--job.config_file", path])
    except ConfigError:
        return (
            None  # a config of another version: the model still loads, the holdout check cannot run
        )


def _pack_path(config: Any | None) -> Path | None:
    if config is None:
        return None
    if config.data.path:
        return Path(config.data.path)
    from torchtitan_loom.components.data import bundled_corpus_path

    return bundled_corpus_path(config.data.cache_dir or None)


def _tokenizer_json(pack: Path | None, override: str | None, export_dir: str | None) -> str | None:
    """The tokenizer.json that pack_tokenizer will load, when it is a file that exists (the same
    choice: --tokenizer, else the pack's recorded one, else the copy in the export folder)."""
    name = override
    if name is None and pack is not None and (Path(pack) / "metadata.json").is_file():
        try:
            recorded = str(pack_tok.pack_tokenizer_info(pack).get("name_or_path", ""))
            name = pack_tok.recorded_tokenizer(Path(pack), recorded)
        except (TokenizerError, AttributeError):
            name = None  # pack_tokenizer itself says what is wrong with the pack
    if (name is None or (name != "byte" and not Path(name).exists())) and export_dir:
        name = export_dir
    if name is None or name == "byte":
        return None
    path = Path(name) / "tokenizer.json" if Path(name).is_dir() else Path(name)
    return str(path) if path.is_file() else None


def load_tokenizer(
    pack: Path | None, override: str | None, model_vocab: int, export_dir: str | None = None
) -> Tokenizer:
    """The pack's tokenizer, or ``override`` when it matches the pack (components/data/tokenizer.py).
    A damaged tokenizer.json is TokenizerFileError naming it (the ``tokenizers`` package raises
    a bare Exception that names no file)."""
    path = _tokenizer_json(pack, override, export_dir)
    if path is not None:
        check_tokenizer_json(path)
    try:
        return pack_tok.pack_tokenizer(pack, override, model_vocab, export_dir)
    except TokenizerError as exc:
        raise LoadError(str(exc)) from None
    except Exception as exc:  # tokenizers' parse errors are plain Exception
        if path is None:
            raise
        raise TokenizerFileError(
            f"tokenizer file {path}: not a tokenizer the tokenizers package can load "
            f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}); "
            "replace it with the tokenizer.json the pack was written with"
        ) from None


def recorded_tokenizer(pack: Path, recorded: str) -> str:
    """The tokenizer a pack's metadata names, resolved inside the pack (components/data/pack_tokenizer.py)."""
    try:
        return pack_tok.recorded_tokenizer(pack, recorded)
    except TokenizerError as exc:
        raise LoadError(str(exc)) from None


def load(
    path: str, device: str = "cpu", tokenizer: str | None = None, need_tokenizer: bool = True
) -> Loaded:
    """Resolve ``path``, rebuild the model in fp32 with capacity off, find config, pack and tokenizer."""
    from torchtitan_loom.components.checkpoint.state import CheckpointError, load_full

    ckpt = resolve_checkpoint(path)
    info: dict[str, Any] | None  # model_args.json's payload
    if is_export_dir(ckpt):
        try:
            info, tensors = read_export(ckpt)
        except ExportError as exc:
            raise LoadError(str(exc)) from None
        config = _read_config(ckpt)
        step = info.get("step")
        export_dir: str | None = ckpt
    else:
        info = read_model_args(ckpt)
        if info is None:
            raise LoadError(
                f"checkpoint {ckpt}: no {names.MODEL_ARGS_JSON}; only checkpoints written by torchtitan_loom load"
            )
        try:
            tensors = load_full(ckpt, prefix="model.")
        except CheckpointError as exc:  # a refused pickle (safe_read.py)
            raise LoadError(f"checkpoint {exc}") from None
        config = _read_config(ckpt)
        step = (layout.read_json(os.path.join(ckpt, names.META_JSON)) or {}).get("step")
        export_dir = None
    spec, args = model_spec(info)
    model = _build(spec, args, tensors, device)
    try:
        pack = _pack_path(config)
    except Exception as exc:  # a missing or broken pack only matters for the tokenizer
        raise LoadError(f"the checkpoint's training pack cannot be opened: {exc}") from None
    tok = load_tokenizer(pack, tokenizer, args.vocab_size, export_dir) if need_tokenizer else None
    return Loaded(
        model=model,
        args=args,
        checkpoint=ckpt,
        step=step,
        config=config,
        pack_path=pack,
        tokenizer=tok,
        flavor=info.get("flavor"),
        name=info["name"],
    )


def check_loops(loops: int | None, model: Any, beyond: str | None = None) -> int:
    """--loops H' (1 <= H' <= 2H); None = H. Past H the model runs under the beyond policy
    ``beyond`` (None: the default, protocols.BEYOND_POLICIES[0]), set here."""
    from torchtitan_loom.protocols import BEYOND_POLICIES, ExitsPerToken

    num_loops = model.num_loops
    if loops is None:
        loops = num_loops
    deeper = isinstance(model, ExitsPerToken)
    top = 2 * num_loops if deeper else num_loops
    if not 1 <= loops <= top:
        past = " (loops past H follow --beyond)" if deeper else ""
        raise LoadError(
            f"--loops {loops}: out of range; valid 1..{top} (the model's H={num_loops}){past}"
        )
    if deeper:
        try:
            model.set_beyond_policy(beyond or BEYOND_POLICIES[0])
        except ValueError as exc:
            raise LoadError(f"--beyond: {exc}") from None
        if beyond is not None and loops <= num_loops:  # it would do nothing
            raise LoadError(
                f"--beyond {beyond}: applies to loops past the trained H={num_loops} only, and "
                f"--loops is {loops}: pass --loops {num_loops + 1}..{top}, or leave --beyond out"
            )
    elif beyond is not None:
        raise LoadError("--beyond: this model cannot run loops past its trained depth")
    return loops


def run_folder(checkpoint: str) -> str | None:
    """The run's dump folder (the one holding metrics.jsonl) above a step-N directory."""
    d = os.path.abspath(checkpoint)
    for _ in range(4):
        if os.path.isfile(os.path.join(d, names.METRICS_JSONL)):
            return d
        d = os.path.dirname(d)
    return None

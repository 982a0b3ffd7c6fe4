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

from torchtitan_loom.components.checkpoint import found, names
from torchtitan_loom.components.data import pack_tokenizer as pack_tok
from torchtitan_loom.components.data.pack_tokenizer import TokenizerError
from torchtitan_loom.components.data.tokenizer import Tokenizer
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
    on_disk: found.FoundCheckpoint | None = None  # what was read (components/checkpoint/found.py)


def resolve_checkpoint(path: str) -> found.FoundCheckpoint:
    """The export folder or the complete, verified DCP directory ``path`` names (found.find);
    LoadError otherwise. A warning it carries is said on stderr."""
    try:
        ck = found.find(path)
    except found.NotACheckpoint as exc:
        raise LoadError(f"checkpoint {exc}") from None
    if ck.note:
        print(f"warning: {ck.note}", file=sys.stderr)
    return ck


def _read_config(path: str | None) -> Any | None:
    """The run's JobConfig from a checkpoint's config.toml; None without one or for one of
    another version (the model still loads; the holdout check says it cannot run)."""
    if path is None:
        return None
    from torchtitan_loom.config import ConfigError, load_config

    try:
        return load_config(["--job.config_file", path])
    except ConfigError:
        return None


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
    ck = resolve_checkpoint(path)
    try:
        spec, args = ck.spec()
        model = ck.build(device, decoding=True)
    except found.NotACheckpoint as exc:
        raise LoadError(f"checkpoint {exc}") from None
    config = _read_config(ck.config_path)
    export_dir = ck.folder if ck.is_export else None
    try:
        pack = _pack_path(config)
    except Exception as exc:  # a missing or broken pack only matters for the tokenizer
        raise LoadError(f"the checkpoint's training pack cannot be opened: {exc}") from None
    tok = load_tokenizer(pack, tokenizer, args.vocab_size, export_dir) if need_tokenizer else None
    info = ck.model_args or {}
    return Loaded(
        model=model,
        args=args,
        checkpoint=ck.folder,
        step=ck.step,
        config=config,
        pack_path=pack,
        tokenizer=tok,
        flavor=info.get("flavor"),
        name=str(ck.spec_name),
        on_disk=ck,
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

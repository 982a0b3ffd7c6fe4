"""The tokenizer a pack was written with, as its metadata records it (training's downstream scoring
and the inference tools load the same one)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchtitan_loom.components.data.pack_format import PackError, read_metadata
from torchtitan_loom.components.data.tokenizer import (
    Tokenizer,
    build_tokenizer,
    same_tokenizer_name,
)


class TokenizerError(ValueError):
    """A tokenizer that cannot be used with this pack or model; the message says which and why."""


def pack_tokenizer_info(pack: Path) -> dict[str, Any]:
    """tokenizer_info of a pack's metadata.json (TokenizerError when unreadable)."""
    try:
        return read_metadata(Path(pack))["tokenizer_info"]
    except PackError as exc:
        raise TokenizerError(str(exc)) from None


def recorded_tokenizer(pack: Path, recorded: str) -> str:
    """The tokenizer a pack's metadata names: 'byte', an absolute path, or a path relative to the
    pack folder (never to the current directory) that stays inside it (TokenizerError otherwise)."""
    if recorded == "byte" or os.path.isabs(recorded):
        return recorded
    path = pack / recorded
    inside = os.path.realpath(pack)
    if os.path.commonpath([os.path.realpath(path), inside]) != inside:
        raise TokenizerError(
            f"the pack {pack} records the tokenizer {recorded!r}, which resolves outside the pack; "
            f"pass --tokenizer (the tokenizer.json the pack was written with)"
        )
    return str(path)


def pack_tokenizer(
    pack: Path | None, override: str | None, model_vocab: int, export_dir: str | None = None
) -> Tokenizer:
    """The pack's tokenizer, or ``override`` when it matches the pack (same name and vocab)."""
    info = (
        pack_tokenizer_info(pack)
        if pack is not None and (Path(pack) / "metadata.json").is_file()
        else None
    )
    name = override
    if info is not None:
        recorded = str(info.get("name_or_path", ""))
        if override is not None and not same_tokenizer_name(override, recorded):
            raise TokenizerError(
                f"--tokenizer {override!r} does not match the pack {pack}, which was tokenised "
                f"with {recorded!r}; pass that tokenizer or leave --tokenizer unset"
            )
        assert pack is not None  # info is only read from a pack
        name = override or recorded_tokenizer(Path(pack), recorded)
        if (
            name != "byte"
            and not Path(name).exists()
            and export_dir
            and Path(export_dir, "tokenizer.json").is_file()
        ):
            name = export_dir  # the pack's HF tokenizer moved; the export carries a copy
    elif name is None and export_dir and Path(export_dir, "tokenizer.json").is_file():
        name = export_dir
    if name is None:
        raise TokenizerError(
            "no tokenizer: the checkpoint's training pack is not readable here; pass --tokenizer "
            "('byte' or the tokenizer.json the pack was written with)"
        )
    try:
        tok = build_tokenizer(name)
    except (ValueError, ImportError) as exc:
        raise TokenizerError(str(exc)) from None
    if info is not None and int(info["vocab_size"]) != tok.vocab_size:
        raise TokenizerError(
            f"tokenizer {name!r} has {tok.vocab_size} ids, the pack {pack} recorded "
            f"{info['vocab_size']}; pass the tokenizer the pack was written with"
        )
    if tok.vocab_size > model_vocab:
        raise TokenizerError(
            f"tokenizer {name!r} has {tok.vocab_size} ids, more than the model's vocab_size {model_vocab}"
        )
    return tok

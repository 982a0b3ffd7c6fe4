"""Export a checkpoint's model for inference or another framework: one consolidated file + args.

    python -m torchtitan_loom.tools.export CKPT OUT [--dtype fp32|bf16] [--verify] [--format safetensors|hf] [--force]

CKPT is a checkpoint directory (``.../checkpoint/step-N``), a checkpoint folder or a run's
dump folder (the newest complete checkpoint inside is used; it is resolved once, and ``--verify``
checks that same step even when the run saves a newer one meanwhile), or an export folder (read
as a checkpoint, components/checkpoint/found.py: re-exported, say in another dtype). OUT must be
absent or empty unless ``--force`` (an existing export is never overwritten by accident); this is
checked before the checkpoint is read. ``--force`` removes only the regular files an export writes (either
format's names, see EXPORT_NAMES) and leaves anything else in OUT; a symbolic link at such a name,
or OUT itself a link when ``--force`` would clear it, is refused (one line, exit 2), never written
or removed through (tools/out_files.py). OUT receives:

    model.safetensors   every model tensor at its full shape, keyed by parameter name
                        (``model.pt``, a plain torch state dict, when safetensors is not installed)
    model_args.json     {"name", "flavor", "args", "dtype", "step", "source", "file"}
    config.toml         the run's resolved config, when the checkpoint has it

Only the model is exported (no optimizer: about a third of the checkpoint). ``--dtype bf16``
casts the floating tensors except those the model's TrainSpec keeps in fp32 (LOOM: the
expert bias, which decides routing). ``--verify``
reads the written file back and compares every tensor bit for bit with the DCP source (cast the
same way). ``--format hf`` writes a Hugging Face folder instead (tools/hf_export.py): config.json,
a generated standalone modeling_loom.py, model.safetensors and the pack's HF tokenizer files. The checkpoint is read without a process group, so any world size's checkpoint works
on one CPU process. ``found.find(OUT).build()`` (components/checkpoint/found.py) rebuilds the
model from the export, as from any checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

if __name__ == "__main__":  # a bad command line or an occupied OUT is answered before torch
    from torchtitan_loom.tools.export_cli import answer_early

    answer_early(sys.argv[1:], __doc__.split("\n\n")[0])
from collections.abc import Callable
from typing import Any

import torch

from torchtitan_loom.components.checkpoint import found, integrity, names
from torchtitan_loom.components.runtime import exit_codes, safe_files
from torchtitan_loom.components.runtime.messages import shorten_line
from torchtitan_loom.distributed.utils import SHORT_DTYPES
from torchtitan_loom.protocols import cast_for_inference
from torchtitan_loom.tools.export_cli import build_parser
from torchtitan_loom.tools.export_format import ExportError, give_umask_mode
from torchtitan_loom.tools.hf_export import HF_NAMES, export_hf
from torchtitan_loom.tools.loading import LoadError, TokenizerFileError, load, load_tokenizer
from torchtitan_loom.tools.out_files import check_out as _check_out
from torchtitan_loom.tools.out_files import clear_out, make_out

# Every name an export writes, in either format: what --force may replace (out_files.py).
EXPORT_NAMES = frozenset(
    {"model.safetensors", "model.pt", names.MODEL_ARGS_JSON, names.CONFIG_TOML, *HF_NAMES}
)


def cast_for_export(
    spec: Any, sd: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Floating tensors to ``dtype`` except what the model keeps in fp32 (protocols.cast_for_inference);
    contiguous and unshared (safetensors' rule)."""
    return {name: t.contiguous().clone() for name, t in cast_for_inference(spec, sd, dtype).items()}


def find(path: str, step: int | None = None) -> found.FoundCheckpoint:
    """The verified checkpoint (or export) ``path`` names (found.find); ExportError otherwise. A
    warning it carries (a checkpoint that predates checksums) is said on stderr."""
    try:
        ck = found.find(path, step)
    except found.NotACheckpoint as exc:
        raise ExportError(str(exc)) from None
    if ck.note:
        print(f"warning: {ck.note}", file=sys.stderr)
    return ck


def _tensors(ck: found.FoundCheckpoint) -> dict[str, torch.Tensor]:
    try:
        return ck.tensors()
    except found.NotACheckpoint as exc:
        raise ExportError(str(exc)) from None


def _spec(ck: found.FoundCheckpoint) -> tuple[Any, Any]:
    try:
        return ck.spec()
    except found.NotACheckpoint as exc:
        raise ExportError(str(exc)) from None


def read_export(out: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(model_args.json payload, tensors) of the export folder ``out``."""
    ck = find(out)
    if not ck.is_export:
        raise ExportError(
            f"{out}: no {names.MODEL_ARGS_JSON} naming a model file; not an export directory"
        )
    return dict(ck.model_args or {}), _tensors(ck)


def check_out(out: str, force: bool) -> None:
    """``out`` may receive an export: absent, an empty directory, or with ``force`` a folder whose
    export files are regular files (no link); ExportError otherwise. Removes nothing."""
    _check_out(out, force, EXPORT_NAMES, ExportError)


def prepare_out(out: str, force: bool) -> None:
    """Right before writing: check ``out`` again, remove an earlier export's files (``force``),
    create the folder."""
    clear_out(out, force, EXPORT_NAMES, ExportError)
    make_out(out, ExportError)


def export(ckpt: str, out: str, dtype: str = "fp32", force: bool = False) -> str:
    """Write the export of ``ckpt`` into ``out`` (which must be empty unless ``force``); returns the
    model file's path. No file is written through a link (safe_files.py)."""
    if dtype not in SHORT_DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(SHORT_DTYPES)}")
    check_out(out, force)
    return _export(find(ckpt), out, dtype, force)


def _export(ck: found.FoundCheckpoint, out: str, dtype: str, force: bool) -> str:
    """``export`` of the checkpoint ``ck`` that ``find`` already verified."""
    spec, args = _spec(ck)
    info = ck.model_args or {}
    tensors = cast_for_export(spec, _tensors(ck), SHORT_DTYPES[dtype])
    prepare_out(out, force)
    save_file: Callable[..., Any] | None
    try:
        from safetensors.torch import save_file
    except ImportError:  # optional dependency (pip install torchtitan_loom[export])
        save_file = None
    name = "model.safetensors" if save_file is not None else "model.pt"
    path = os.path.join(out, name)
    fd, tmp = safe_files.new_temp(path)  # created O_EXCL | O_NOFOLLOW: never written through a link
    os.close(fd)
    try:
        if save_file is not None:
            save_file(tensors, tmp, metadata={"format": "pt", "dtype": dtype})
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp) and not os.path.islink(tmp):
            os.remove(tmp)
    record = {
        "name": info["name"],
        "flavor": info.get("flavor"),
        "args": dataclasses.asdict(args),
        "dtype": dtype,
        "step": ck.step,
        "source": os.path.abspath(ck.folder),
        "file": name,
    }  # written as the export's own file (the checkpoint package is entered once: found.find)
    safe_files.atomic_write(
        os.path.join(out, names.MODEL_ARGS_JSON),
        json.dumps(record, indent=2, sort_keys=True) + "\n",
        owner=out,
    )
    written = [name, names.MODEL_ARGS_JSON]
    if ck.config_path is not None:
        text = safe_files.read_text(ck.config_path)
        safe_files.atomic_write(os.path.join(out, names.CONFIG_TOML), text, owner=out)
        written.append(names.CONFIG_TOML)
    give_umask_mode(out, written)
    return path


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def verify(ckpt: str | None, out: str) -> int:
    """Compare every exported tensor bit for bit with the DCP source; returns how many matched.
    ``ckpt``: a step-N directory is used as it is; a checkpoint or run folder gives its checkpoint
    of the step the export records (not the newest: the run may have saved another since); None:
    the checkpoint directory the export records as its source."""
    info, exported = read_export(out)
    step = info.get("step")
    if ckpt is None:
        ckpt = info.get("source")
        if not isinstance(ckpt, str):
            raise ExportError(
                f"{out}: {names.MODEL_ARGS_JSON} records no source; name the checkpoint"
            )
    return _verify(find(ckpt, step if isinstance(step, int) else None), info, exported, out)


def _verify(
    ck: found.FoundCheckpoint, info: dict[str, Any], exported: dict[str, torch.Tensor], out: str
) -> int:
    """``verify`` against the checkpoint ``ck`` that ``find`` already verified."""
    spec, _ = _spec(ck)
    source = _tensors(ck)
    bad = integrity.nonfinite_names(source)
    if bad:
        raise ExportError(f"{ck.folder}: non-finite weights in the checkpoint ({', '.join(bad)})")
    expected = cast_for_export(spec, source, SHORT_DTYPES[info["dtype"]])
    problems = [f"{k}: missing from the export" for k in sorted(expected.keys() - exported.keys())]
    problems += [f"{k}: not in the checkpoint" for k in sorted(exported.keys() - expected.keys())]
    for k in sorted(expected.keys() & exported.keys()):
        a, b = expected[k], exported[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(
                f"{k}: export {b.dtype} {list(b.shape)}, checkpoint {a.dtype} {list(a.shape)}"
            )
        elif not torch.equal(_bits(a), _bits(b)):
            problems.append(f"{k}: values differ")
    if problems:
        raise ExportError(
            f"verification of {out} against {ck.folder} failed:\n  " + "\n  ".join(problems[:20])
        )
    return len(expected)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns 0, or 2 with one ``export error:`` message."""
    parser = build_parser(__doc__.split("\n\n")[0])
    ns = parser.parse_args(argv)
    if ns.format == "hf":
        return _main_hf(ns)
    try:
        check_out(ns.out, ns.force)  # before the checkpoint is read (checksums read every byte)
        print(f"export: reading the model of {ns.ckpt} ...", flush=True)
        ck = find(ns.ckpt)  # once: --verify checks this step, whatever comes after
        path = _export(ck, ns.out, ns.dtype, ns.force)
        print(f"exported {ck.folder} → {path} ({ns.dtype})")
        if ns.verify:
            print(f"export: verifying {path} against {ck.folder} ...", flush=True)
            info, exported = read_export(ns.out)
            count = _verify(ck, info, exported, ns.out)
            print(f"verified: {count} tensors bit-identical to the checkpoint")
    except (ExportError, OSError) as exc:
        print(shorten_line(f"export error: {exc}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    return exit_codes.OK


def _main_hf(ns: argparse.Namespace) -> int:

    if ns.verify:
        print("export error: --verify applies to --format safetensors only", file=sys.stderr)
        return exit_codes.BAD_INPUT
    try:
        check_out(ns.out, ns.force)  # before the checkpoint is read
        print(f"export: loading {ns.ckpt} ...", flush=True)
        loaded = load(ns.ckpt, need_tokenizer=False)
        try:
            loaded.tokenizer = load_tokenizer(
                loaded.pack_path, None, loaded.args.vocab_size, loaded.checkpoint
            )
        except TokenizerFileError:
            raise  # a damaged tokenizer.json is an error, not a folder without tokenizer files
        except LoadError as exc:
            print(f"export: no tokenizer files ({exc})", file=sys.stderr)
        print(f"export: writing the Hugging Face folder {ns.out} ...", flush=True)
        prepare_out(ns.out, ns.force)
        files = export_hf(loaded, ns.out, SHORT_DTYPES[ns.dtype])
    except (LoadError, ExportError, OSError) as exc:
        print(shorten_line(f"export error: {exc}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    except ImportError as exc:
        print(
            f"export error: --format hf needs safetensors and tokenizers ({exc}); "
            "pip install 'torchtitan_loom[hf]'",
            file=sys.stderr,
        )
        return exit_codes.BAD_INPUT
    print(
        f"exported {loaded.checkpoint} (step {loaded.step}) → {ns.out} as a Hugging Face folder "
        f"({ns.dtype}): {', '.join(files)}"
    )
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())

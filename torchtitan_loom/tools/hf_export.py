"""``tools.export CKPT OUT --format hf``: a folder that transformers loads with
``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``.

    config.json           LoomConfig: the LOOM args, auto_map, vocab/eos, the checkpoint step
    modeling_loom.py      GENERATED at export time: the source of models/loom/{args, looping_residual,
                          attention, moe, block, model}.py and the two output types of protocols.py,
                          with the package-internal imports removed, then the thin wrapper of
                          models/loom/infra/hf_wrapper_template.py. One copy of the same math, no second
                          implementation to keep in sync; it imports nothing from torchtitan_loom.
    model.safetensors     the parameters (fp32 or bf16) and the fp32 expert bias, keys "model.<name>"
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
                          the pack's own tokenizer.json when it has one; for the byte tokenizer a
                          ``tokenizers`` serialisation of it (ids 0..255 the bytes, 256 EOS
                          "<|endoftext|>", 257 PAD "<pad>"), so ``AutoTokenizer`` needs no remote code
                          and gives the ids the model was trained on

Every file gets the mode the umask gives (export_format.give_umask_mode). Every file is written
through a temporary file created O_EXCL | O_NOFOLLOW and renamed (tools/out_files.py), never
through a symbolic link planted at its name.

transformers 5.x's ``AutoTokenizer.from_pretrained(OUT)`` reads config.json first, whose
``auto_map`` names the remote LoomConfig: without ``trust_remote_code`` it asks the [y/N] question
(answered "no" at once when stdin is closed, after which the tokenizer loads);
``PreTrainedTokenizerFast.from_pretrained(OUT)`` or ``trust_remote_code=True`` skip it. A
model_type transformers registers would silence it, at the price of config.json naming another
architecture; the export keeps "loom".
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from pathlib import Path

import torch

import torchtitan_loom
from torchtitan_loom.components.runtime import safe_files
from torchtitan_loom.tools.export_format import give_umask_mode
from torchtitan_loom.tools.loading import Loaded
from torchtitan_loom.tools.out_files import write_file

MODELING_FILE = "modeling_loom.py"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HF_NAMES = ("config.json", MODELING_FILE, "model.safetensors", *TOKENIZER_FILES)
_PKG = Path(torchtitan_loom.__file__).parent
# Stitch order: every module after the ones it imports from.
MODEL_SOURCES = (
    "data_contract.py",
    "models/loom/args.py",
    "models/loom/target.py",
    "models/loom/flex_compiled.py",
    "models/loom/looping_residual.py",
    "models/loom/attention.py",
    "models/loom/swiglu.py",
    "models/loom/moe.py",
    "models/loom/block.py",
    "models/loom/expert_bias.py",
    "models/loom/counts.py",
    "models/loom/weight_init.py",
)
PROTOCOL_NAMES = ("ModelOutput", "Routing")
WRAPPER_SOURCE = "models/loom/infra/hf_wrapper_template.py"


def _is_internal(node: ast.stmt) -> bool:
    """An import of the package itself, or ``from __future__`` (hoisted to the top once)."""
    if isinstance(node, ast.ImportFrom):
        return node.module == "__future__" or (node.module or "").startswith("torchtitan_loom")
    if isinstance(node, ast.Import):
        return any(a.name.startswith("torchtitan_loom") for a in node.names)
    return False


def _strip(source: str, keep: tuple[str, ...] | None = None) -> tuple[str, set[str]]:
    """The module source without internal imports (only the top-level definitions named in
    ``keep`` when given, plus its plain imports), and the names it defines at top level."""
    tree = ast.parse(source)
    lines = source.splitlines()
    pieces, defined = [], set()
    for node in tree.body:
        if _is_internal(node):
            continue
        name = getattr(node, "name", None)
        if (
            keep is not None
            and not isinstance(node, (ast.Import, ast.ImportFrom))
            and name not in keep
        ):
            continue
        if name is not None:
            defined.add(name)
        for target in getattr(node, "targets", []):
            if isinstance(target, ast.Name):
                defined.add(target.id)
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        # Lazy internal imports inside functions go too: their names are stitched in at top level.
        nested = {
            n
            for sub in ast.walk(node)
            if sub is not node
            and isinstance(sub, (ast.Import, ast.ImportFrom))
            and _is_internal(sub)
            for n in range(sub.lineno, sub.end_lineno + 1)
        }
        text = "\n".join(
            line
            for n, line in enumerate(lines[start - 1 : node.end_lineno], start)
            if n not in nested
        )
        is_import = isinstance(node, (ast.Import, ast.ImportFrom))
        if pieces and not (is_import and pieces[-1][0]):
            text = "\n\n" + text  # PEP 8 spacing between top-level statements
        pieces.append((is_import, text))
    return "\n".join(text for _, text in pieces), defined


def modeling_source() -> str:
    """The standalone modeling file (see the module doc)."""
    parts = [
        '"""LOOM for transformers: GENERATED by `python -m torchtitan_loom.tools.export --format hf` from\n'
        'the torchtitan_loom model source; do not edit (regenerate it instead)."""\n',
        "from __future__ import annotations\n",
    ]
    seen: dict[str, str] = {}
    sources = [(s, None) for s in MODEL_SOURCES] + [
        ("protocols.py", PROTOCOL_NAMES),
        ("models/loom/model.py", None),
        (WRAPPER_SOURCE, None),
    ]
    for rel, keep in sources:
        body, defined = _strip((_PKG / rel).read_text(), keep)
        clash = sorted(n for n in defined if n in seen and not n.isupper())
        if clash:
            raise RuntimeError(
                f"{rel} redefines {clash} already defined by {seen[clash[0]]}; rename one of them"
            )
        seen.update({n: rel for n in defined})
        parts.append(f"\n# {'-' * 70} from torchtitan_loom/{rel}\n\n{body}\n")
    return "\n".join(parts)


# The byte tokenizer's special tokens, spelled as HFTokenizer (components/data/tokenizer.py)
# finds them again: the first EOS candidate and "<pad>".
BYTE_EOS, BYTE_PAD = "<|endoftext|>", "<pad>"


def _byte_symbols() -> list[str]:
    """The printable character ByteLevel pre-tokenisation maps each byte 0..255 to: printable
    Latin-1 bytes stand for themselves, the others take the code points from 256 on, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def byte_tokenizer_json(path: str) -> None:
    """Write the byte tokenizer (ByteTokenizer) as a ``tokenizers`` tokenizer.json: a BPE model
    without merges over the 256 byte symbols (id = byte value), ByteLevel pre-tokenizer and
    decoder, EOS 256 and PAD 257 as special tokens. Never through a link at ``path``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {sym: b for b, sym in enumerate(_byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (BYTE_EOS, BYTE_PAD)])
    write_file(path, tok.to_str(pretty=True), os.path.dirname(path) or ".")


def _tokenizer_files(loaded: Loaded, out: str) -> list[str]:
    """tokenizer.json (the pack's, or the byte tokenizer's) + a tokenizer_config.json naming EOS/PAD."""
    from torchtitan_loom.components.data.tokenizer import ByteTokenizer, HFTokenizer

    tok = loaded.tokenizer
    if isinstance(tok, HFTokenizer):
        src = Path(tok.name_or_path)
        src = src / "tokenizer.json" if src.is_dir() else src
        with open(src, "rb") as fh:  # the file the tokenizer was just built from
            write_file(os.path.join(out, "tokenizer.json"), fh.read(), out)
        eos = tok._tok.id_to_token(tok.eos_id)
        pad = None if tok.pad_id is None else tok._tok.id_to_token(tok.pad_id)
    elif isinstance(tok, ByteTokenizer):
        byte_tokenizer_json(os.path.join(out, "tokenizer.json"))
        eos, pad = BYTE_EOS, BYTE_PAD
    else:
        return []
    # An explicit class: transformers builds PreTrainedTokenizerFast from tokenizer.json, no remote code.
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "model_max_length": loaded.args.max_seq_len,
    }
    if pad is not None:
        cfg["pad_token"] = pad
    write_file(os.path.join(out, "tokenizer_config.json"), json.dumps(cfg, indent=2), out)
    special = {k: v for k, v in cfg.items() if k.endswith("_token")}
    write_file(os.path.join(out, "special_tokens_map.json"), json.dumps(special, indent=2), out)
    return list(TOKENIZER_FILES)


def export_hf(loaded: Loaded, out: str, dtype: torch.dtype = torch.float32) -> list[str]:
    """Write the HF folder for ``loaded`` into ``out``; returns the file names written."""
    from safetensors.torch import save_file

    os.makedirs(
        out, exist_ok=True
    )  # export.prepare_out made and checked it; a library call may not
    write_file(os.path.join(out, MODELING_FILE), modeling_source(), out)
    buffers = {name for name, _ in loaded.model.named_buffers()}
    tensors = {}
    for name, t in loaded.model.state_dict().items():
        if torch.is_floating_point(t) and name not in buffers:
            t = t.to(dtype)
        tensors["model." + name] = t.detach().contiguous().clone()
    path = os.path.join(out, "model.safetensors")
    fd, tmp = safe_files.new_temp(path)  # created O_EXCL | O_NOFOLLOW, then renamed over the name
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp) and not os.path.islink(tmp):
            os.remove(tmp)
    tok = loaded.tokenizer
    config = {
        "architectures": ["LoomForCausalLM"],
        "model_type": "loom",
        "auto_map": {
            "AutoConfig": "modeling_loom.LoomConfig",
            "AutoModelForCausalLM": "modeling_loom.LoomForCausalLM",
        },
        "loom_args": dataclasses.asdict(loaded.args),
        "loops": None,
        "vocab_size": loaded.args.vocab_size,
        "max_position_embeddings": loaded.args.max_seq_len,
        "eos_token_id": None if tok is None else tok.eos_id,
        "pad_token_id": None if tok is None else tok.pad_id,
        "use_cache": False,
        "dtype": str(dtype).replace("torch.", ""),
        "torchtitan_loom": {
            "step": loaded.step,
            "source": os.path.abspath(loaded.checkpoint),
            "flavor": loaded.flavor,
        },
    }
    write_file(os.path.join(out, "config.json"), json.dumps(config, indent=2) + "\n", out)
    files = ["config.json", MODELING_FILE, "model.safetensors"] + _tokenizer_files(loaded, out)
    give_umask_mode(out, files)
    return files

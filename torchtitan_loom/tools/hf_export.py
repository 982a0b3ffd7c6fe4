"""``tools.export CKPT OUT --format hf``: a folder that transformers loads with
``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``.

    config.json           the model's fields (LOOM: LoomConfig, the args, auto_map), vocab/eos, the
                          checkpoint step
    modeling_loom.py      GENERATED at export time by the model's TrainSpec.hf_export_fn (LOOM:
                          models/loom/infra/hf_source.py, from the package's own model source); a
                          model whose spec has none is refused with one line
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

import json
import os
from pathlib import Path

import torch

from torchtitan_loom.components.runtime import safe_files
from torchtitan_loom.protocols import get_train_spec
from torchtitan_loom.tools.export_format import ExportError, give_umask_mode
from torchtitan_loom.tools.loading import Loaded
from torchtitan_loom.tools.out_files import write_file

MODELING_FILE = "modeling_loom.py"  # LOOM's (models/loom/infra/hf_source.py): cleared by --force
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HF_NAMES = ("config.json", MODELING_FILE, "model.safetensors", *TOKENIZER_FILES)

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

    spec = get_train_spec(loaded.name)
    if spec.hf_export_fn is None:
        raise ExportError(
            f"model '{loaded.name}' has no Hugging Face export (its TrainSpec sets no "
            f"hf_export_fn); export it with --format safetensors"
        )
    hf = spec.hf_export_fn(loaded.args)
    os.makedirs(
        out, exist_ok=True
    )  # export.prepare_out made and checked it; a library call may not
    write_file(os.path.join(out, hf.modeling_file), hf.modeling_source, out)
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
        **hf.config,
        "eos_token_id": None if tok is None else tok.eos_id,
        "pad_token_id": None if tok is None else tok.pad_id,
        "dtype": str(dtype).replace("torch.", ""),
        "torchtitan_loom": {
            "step": loaded.step,
            "source": os.path.abspath(loaded.checkpoint),
            "flavor": loaded.flavor,
        },
    }
    write_file(os.path.join(out, "config.json"), json.dumps(config, indent=2) + "\n", out)
    files = ["config.json", hf.modeling_file, "model.safetensors"] + _tokenizer_files(loaded, out)
    give_umask_mode(out, files)
    return files

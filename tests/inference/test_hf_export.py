"""export --format hf: transformers loads the folder (trust_remote_code) and its logits equal the
project model's in fp32; generate() works and matches the project's cached greedy decoding; the
modeling file is generated from the model source and imports nothing from torchtitan_loom; an HF
tokenizer of the pack travels with it."""

import ast
import inspect
import json
import os
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtitan_loom.components.evaluation.sampling import SamplingConfig, generate  # noqa: E402
from torchtitan_loom.models.loom import attention, looping_residual, model  # noqa: E402
from torchtitan_loom.models.loom.infra.hf_source import MODELING_FILE, modeling_source  # noqa: E402
from torchtitan_loom.tools import export as export_tool  # noqa: E402
from torchtitan_loom.tools.hf_export import _tokenizer_files  # noqa: E402
from torchtitan_loom.tools.loading import Loaded, load  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    assert export_tool.main([str(trained_run), str(out), "--format", "hf"]) == 0
    return out


def test_folder_layout_and_standalone_generated_modeling_file(hf_dir):
    cfg = json.load(open(hf_dir / "config.json"))
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_loom.LoomForCausalLM"
    assert cfg["loom_args"]["num_loops"] == 3 and cfg["loom_args"]["capacity_factor"] == 1.5
    assert cfg["torchtitan_loom"]["step"] == 40 and cfg["eos_token_id"] == 256
    assert os.path.isfile(hf_dir / "model.safetensors")
    src = (hf_dir / MODELING_FILE).read_text()
    assert src == modeling_source()  # regenerated, not stored
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
            )
            assert not any(n.startswith("torchtitan_loom") for n in names), ast.unparse(node)
            # transformers imports torchao itself when it is installed; the export adds no import.
            assert not any(n.startswith("torchao") for n in names), ast.unparse(node)
    # The math is the package's own source, verbatim.
    for fn in (
        looping_residual.looping_residual_write,
        attention.apply_rope,
        model.LoomTransformer._run_loop,
    ):
        assert inspect.getsource(fn).strip() in src


def test_logits_equal_the_project_model_and_generate_works(trained_run, hf_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), trust_remote_code=True
    ).eval()
    ours = load(str(trained_run)).model
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(ids, torch.arange(20).expand_as(ids), torch.zeros_like(ids)).logits_BSV
        got = hf(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

    # Left padding: the padded row's real positions equal the unpadded row's logits.
    short = ids[1:, 5:]
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), short], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(short)], dim=1)
    with torch.no_grad():
        alone = ours(short, torch.arange(15)[None], torch.zeros_like(short)).logits_BSV
        in_batch = hf(padded, attention_mask=mask).logits[:, 5:]
    torch.testing.assert_close(in_batch, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())

    prompt = torch.tensor([list(b"the cat sat on")])
    with torch.no_grad():
        out = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False
        )
        ref = generate(ours, prompt, SamplingConfig(max_new_tokens=8, temperature=0), eos_id=256)
    new = out[0, prompt.shape[1] :].tolist()
    assert new == ref[0, : len(new)].tolist() and len(new) >= 1
    assert bytes(t for t in new if t < 256).startswith(b" the mat")


def test_hf_tokenizer_of_the_pack_is_exported(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from torchtitan_loom.components.data.tokenizer import HFTokenizer

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"]
    )
    tok.train_from_iterator(["the cat sat on the mat"] * 50 + ["12+30=42."] * 50, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = HFTokenizer(str(tmp_path / "tokenizer.json"))
    args = type("Args", (), {"max_seq_len": 256})()
    loaded = Loaded(
        model=None, args=args, checkpoint="", step=None, config=None, pack_path=None, tokenizer=ours
    )
    out = tmp_path / "out"
    out.mkdir()
    assert _tokenizer_files(loaded, str(out)) == [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "the cat sat on 12+30"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert hf_tok.eos_token_id == ours.eos_id


def test_hf_export_of_a_missing_or_incomplete_checkpoint_is_exit_2(trained_run, tmp_path, capsys):
    import shutil

    torn = tmp_path / "torn"
    shutil.copytree(trained_run / "checkpoint" / "step-20", torn)
    os.remove(torn / "COMPLETE")
    for ckpt, expected in (
        (tmp_path / "none", "no such file or directory"),
        (torn, "incomplete checkpoint"),
    ):
        assert export_tool.main([str(ckpt), str(tmp_path / "out"), "--format", "hf"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("export error: ") and err.count("\n") == 1 and expected in err, err
    assert not os.path.exists(tmp_path / "out")


def test_byte_tokenizer_loads_in_plain_transformers_with_the_training_ids(
    trained_run, hf_dir, capfd
):
    """No remote code for the tokenizer: AutoTokenizer builds PreTrainedTokenizerFast from the
    exported tokenizer.json (pytest's stdin cannot be read, as a closed one), the ids are the
    pack's tokenizer's, the text comes back, EOS and PAD are the trained ones."""
    pack_tok = load(str(trained_run)).tokenizer
    text = "variables: x = 1\nhéllo wörld\t{ } 🙂"
    for hf_tok in (
        transformers.AutoTokenizer.from_pretrained(str(hf_dir)),
        transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir)),
    ):
        ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        assert ids == pack_tok.encode(text) == list(text.encode("utf-8"))
        assert hf_tok.decode(ids) == text
        assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (pack_tok.eos_id, pack_tok.pad_id)
        assert hf_tok.decode([*ids, pack_tok.eos_id], skip_special_tokens=True) == text
    capfd.readouterr()
    transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    assert "[y/N]" not in "".join(capfd.readouterr())  # the tokenizer class asks nothing


def test_text_generation_pipeline_generates_the_project_greedy_text(trained_run, hf_dir):
    pipe = transformers.pipeline("text-generation", model=str(hf_dir), trust_remote_code=True)
    prompt = "the cat sat on"
    got = pipe(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    ours = load(str(trained_run))
    ids = torch.tensor([ours.tokenizer.encode(prompt)])
    ref = generate(ours.model, ids, SamplingConfig(max_new_tokens=8, temperature=0), eos_id=256)
    assert got.startswith(prompt) and len(got) > len(prompt)
    assert got == prompt + ours.tokenizer.decode(ref[0].tolist())


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_exported_files_get_the_umask_mode(trained_run, tmp_path, fmt):
    """0640 under umask 027 (0644 under 022): safetensors alone would write the model file 0600."""
    old = os.umask(0o027)
    try:
        out = tmp_path / fmt
        assert export_tool.main([str(trained_run), str(out), "--format", fmt]) == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes and set(modes.values()) == {0o640}, modes


def test_the_stitched_sources_follow_the_model_imports():
    """Issue 36: the modeling file's sources are derived from model.py's imports (a module the
    model starts to import is stitched in by construction; swiglu.py went missing from the hand
    list once). Each module comes after every stitched module it imports from."""
    import ast

    from torchtitan_loom.models.loom.infra import hf_source

    order = hf_source.model_sources()
    assert "models/loom/swiglu.py" in order and "data_contract.py" in order
    assert not any(s.startswith("models/loom/infra/") for s in order)
    for i, rel in enumerate(order):
        tree = ast.parse((hf_source._PKG / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torchtitan_loom"
            ):
                for dep in hf_source._imported_files(node):
                    if dep in order:
                        assert order.index(dep) < i, (rel, dep)


def test_a_model_without_an_hf_exporter_is_one_line(tmp_path, capsys):
    """A spec without hf_export_fn: export --format hf refuses it in one line (exit 2) instead of
    writing LOOM's modeling file for another model."""
    import dataclasses

    from torchtitan_loom.protocols import get_train_spec, register_train_spec
    from torchtitan_loom.tools import hf_export

    loom = get_train_spec("loom")
    register_train_spec(
        "loom_no_hf", dataclasses.replace(loom, name="loom_no_hf", hf_export_fn=None)
    )
    loaded = SimpleNamespace(name="loom_no_hf", args=None)
    with pytest.raises(
        hf_export.ExportError, match="model 'loom_no_hf' has no Hugging Face export"
    ):
        hf_export.export_hf(loaded, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_learned_exit_head_travels_with_the_hf_export(tiny_pack, tmp_path):
    """A checkpoint with model.exit_head: transformers loads every head weight (no key missing or
    unexpected), and the loaded model's exit head predicts what the project model's does."""
    from test_checkpoint import make_trainer, run

    from torchtitan_loom.components.evaluation.loop_by_loop import each_loop

    args = ("--training.steps", "3", "--checkpoint.interval", "3", "--model.exit_head", "true")
    run(make_trainer(tiny_pack, tmp_path / "run", *args, "--training.bp_segment_len", "1"))
    out = tmp_path / "hf"
    assert export_tool.main([str(tmp_path / "run"), str(out), "--format", "hf"]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), trust_remote_code=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = load(str(tmp_path / "run")).model
    assert ours.exit_head is not None and hf.model.exit_head is not None
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    mb = {"input_ids": ids, "positions": torch.arange(12)[None], "doc_ids": torch.zeros_like(ids)}
    with torch.no_grad():
        want = [ours.exit_gain(o.carry, t) for t, o in each_loop(ours, mb, range(1, 3))]
        got = [hf.model.exit_gain(o.carry, t) for t, o in each_loop(hf.model, mb, range(1, 3))]
    assert any(w.abs().max() > 0 for w in want)  # the head moved from its zero output
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)

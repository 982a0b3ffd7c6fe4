"""tools/generate.py and the shared loader: sampling from a run folder, a step-N directory and an
export; cached greedy decoding equals recomputing the prefix on a trained model; bad input."""

import os
import shutil

import torch

from torchtitan_loom.tools import export as export_tool
from torchtitan_loom.tools import generate as gen_tool
from torchtitan_loom.tools.loading import load


def generate_cli(capsys, *argv):
    """(exit code, stdout, stderr without the progress line that announces the load)."""
    code = gen_tool.main(list(argv))
    out, err = capsys.readouterr()
    loading = f"generate: loading {argv[0]} ...\n"
    assert err.count(loading) <= 1
    return code, out, err.replace(loading, "")


def greedy_by_recompute(model, ids, steps):
    seq = torch.tensor([ids])
    for _ in range(steps):
        out = model(seq, torch.arange(seq.shape[1])[None], torch.zeros_like(seq))
        seq = torch.cat([seq, out.logits_BSV[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(ids) :].tolist()


def test_loader_gives_capacity_off_fp32_and_the_pack_tokenizer(trained_run):
    loaded = load(str(trained_run))
    assert loaded.checkpoint == str(trained_run / "checkpoint" / "step-40") and loaded.step == 40
    assert loaded.args.capacity_factor == 1.5  # as trained (the holdout check needs it)
    assert loaded.model.args.capacity_factor == 0 and not loaded.model.training
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    assert loaded.tokenizer.name_or_path == "byte"
    older = load(str(trained_run / "checkpoint" / "step-20"))
    assert older.step == 20
    assert not torch.equal(older.model.output.weight, loaded.model.output.weight)


def test_greedy_generation_matches_recompute_and_learned_text(trained_run, capsys):
    code, out, _ = generate_cli(
        capsys,
        str(trained_run),
        "--prompt",
        "the cat sat on the",
        "--temperature",
        "0",
        "--max-new-tokens",
        "4",
    )
    assert code == 0
    assert out.startswith("the cat sat on the mat")  # the pack's sentence, learned in 40 steps
    loaded = load(str(trained_run))
    ids = loaded.tokenizer.encode("the cat sat on the")
    with torch.no_grad():
        ref = greedy_by_recompute(loaded.model, ids, 4)
    assert out.rstrip("\n") == "the cat sat on the" + loaded.tokenizer.decode(
        [t for t in ref if t != 256]
    )


def test_sampling_seed_loops_and_export_folder(trained_run, tmp_path, capsys):
    args = [
        "--prompt",
        "12+",
        "--temperature",
        "1.5",
        "--top-k",
        "20",
        "--top-p",
        "0.95",
        "--max-new-tokens",
        "12",
    ]
    a = generate_cli(capsys, str(trained_run), *args, "--seed", "1")
    b = generate_cli(capsys, str(trained_run), *args, "--seed", "1")
    c = generate_cli(capsys, str(trained_run), *args, "--seed", "2")
    assert a[0] == b[0] == c[0] == 0 and a[1] == b[1] and a[1] != c[1]
    export_tool.main([str(trained_run), str(tmp_path / "exp")])
    capsys.readouterr()
    from_export = generate_cli(capsys, str(tmp_path / "exp"), *args, "--seed", "1")
    assert from_export[0] == 0 and from_export[1] == a[1]
    early = generate_cli(
        capsys, str(trained_run), "--prompt", "the cat", "--loops", "1", "--temperature", "0"
    )
    assert early[0] == 0 and early[1].startswith("the cat")
    # The load is announced on stderr before it runs; stdout holds only the text.
    assert gen_tool.main([str(trained_run), "--prompt", "the", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert err == f"generate: loading {trained_run} ...\n" and out.startswith("the")


def test_bad_input_is_one_line_and_exit_2(trained_run, tmp_path, capsys):
    torn = tmp_path / "torn"
    shutil.copytree(trained_run / "checkpoint" / "step-40", torn)
    os.remove(torn / "COMPLETE")
    cases = [
        ([str(tmp_path / "nothing"), "--prompt", "x"], "no such file or directory"),
        ([str(torn), "--prompt", "x"], "incomplete checkpoint"),
        (
            [str(trained_run), "--prompt", "x", "--loops", "7"],
            "--loops 7: out of range; valid 1..6 (the model's H=3)",
        ),
        (
            [str(trained_run), "--prompt", "x", "--beyond", "wrap"],
            "--beyond: beyond-H policy 'wrap'",
        ),
        (
            [str(trained_run), "--prompt", "x", "--exit", "kl", "--exit-threshold", "-1"],
            "--exit kl threshold -1.0: must be a finite number ≥ 0",
        ),
        (
            [str(trained_run), "--prompt", "x", "--exit", "entropy"],
            "--exit exit criterion 'entropy': valid kl, confidence, learned",
        ),
        (
            [str(trained_run), "--prompt", "x", "--exit-threshold", "0.1"],
            "--exit-threshold needs --exit kl, confidence or learned",
        ),
        (
            [str(trained_run), "--prompt", "x", "--exit", "learned", "--exit-threshold", "0.5"],
            "--exit exit criterion learned: this checkpoint has no exit head",
        ),
        ([str(trained_run), "--prompt", "x", "--loops", "0"], "--loops 0: out of range"),
        (
            [str(trained_run), "--prompt", "x" * 300],
            "--prompt is 300 tokens; the model takes at most max_seq_len=256",
        ),
        (
            [str(trained_run), "--prompt", "x", "--tokenizer", "HuggingFaceTB/SmolLM"],
            "does not match the pack",
        ),
        ([str(trained_run), "--prompt", "x", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    ]
    for argv, expected in cases:
        code, out, err = generate_cli(capsys, *argv)
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and expected in err and err.startswith("generate error: "), err
        assert out == ""

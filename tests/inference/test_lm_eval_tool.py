"""tools/lm_eval.py end to end on a tiny local multiple-choice task: results folder with step,
commit, config and the holdout check; scores equal an independent log-likelihood computation and
do not depend on the batch size; with --exit each token is scored at its exit loop and the mean
loops are recorded; the holdout check trips on perturbed weights; two ranks (torchrun, gloo) give
the single-rank scores; bad input exits 2."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

# The tiny local tasks (lm-eval YAML + jsonl); nothing can be downloaded in tests.
TASKS_DIR = os.path.join(os.path.dirname(__file__), "tiny_tasks")

from torchtitan_loom.tools import export as export_tool  # noqa: E402
from torchtitan_loom.tools import lm_eval as eval_tool  # noqa: E402
from torchtitan_loom.tools.loading import load  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TASK = ["--tasks", "loom_tiny_mc", "--tasks-dir", TASKS_DIR, "--only-tasks-dir"]


def run_eval(capsys, ckpt, out, *extra):
    code = eval_tool.main([str(ckpt), *TASK, "--out", str(out), *extra])
    stdout, err = capsys.readouterr()
    found = sorted(glob.glob(os.path.join(str(out), "*", "results.json")))
    return code, (json.load(open(found[-1])) if found and code == 0 else None), stdout, err


def lls(result):
    return [
        [r[0] for r in s["resps"]]
        for s in sorted(result["samples"]["loom_tiny_mc"], key=lambda s: s["doc_id"])
    ]


def reference_loglikelihood(model, ctx, cont):
    """Sum of log p(cont | ctx) from one plain forward, independent of the adapter."""
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logits = model(
            ids[:, :-1], torch.arange(ids.shape[1] - 1)[None], torch.zeros_like(ids[:, :-1])
        ).logits_BSV
    logp = F.log_softmax(logits[0, len(ctx) - 1 :], dim=-1)
    return logp.gather(1, torch.tensor(cont)[:, None]).sum().item()


def test_end_to_end_results_scores_and_batch_size_independence(trained_run, tmp_path, capsys):
    code, r1, stdout, err = run_eval(capsys, trained_run, tmp_path / "b1", "--batch-size", "1")
    assert stdout.startswith(
        f"lm_eval: loading lm-eval, then the checkpoint {trained_run} ...\n"
    )  # before the slow part
    assert code == 0, err
    assert "lm_eval: scoring loom_tiny_mc (step 40) ..." in stdout
    # Neither lm-eval's per-task progress bars nor its hint for its own CLI reach the console.
    assert "Custom kwargs" not in err and not re.search(r"\d+%\|", err), err
    assert r1["step"] == 40 and r1["checkpoint"].endswith("step-40")
    assert r1["commit"] and r1["config"]["training"]["seq_len"] == 32
    assert r1["scoring"]["capacity"] == "off" and r1["scoring"]["param_dtype"] == "fp32"
    h = r1["holdout"]
    assert h["mode"] == "on" and h["logged_eval_loss"] is not None and h["gap"] <= 1e-6
    assert "| loom_tiny_mc | acc |" in stdout and os.path.isfile(
        glob.glob(str(tmp_path / "b1" / "*" / "summary.md"))[0]
    )

    # Every choice's score equals an independent forward; acc is the share of argmax == gold.
    docs = [json.loads(line) for line in open(os.path.join(TASKS_DIR, "loom_tiny_mc.jsonl"))]
    loaded = load(str(trained_run))
    enc = loaded.tokenizer.encode
    scores = lls(r1)
    assert len(scores) == len(docs) == 12
    for doc, row in zip(docs, scores):
        ref = [
            reference_loglikelihood(loaded.model, enc(doc["query"]), enc(c)) for c in doc["choices"]
        ]
        assert row == pytest.approx(ref, rel=1e-5, abs=1e-5)
    acc = sum(
        max(range(len(s)), key=s.__getitem__) == d["gold"] for s, d in zip(scores, docs)
    ) / len(docs)
    assert r1["results"]["loom_tiny_mc"]["acc,none"] == pytest.approx(acc)
    assert acc >= 0.5  # the "the cat sat on the" -> " mat" half is learned

    code, r5, _, _ = run_eval(
        capsys, trained_run, tmp_path / "b5", "--batch-size", "5", "--holdout-check", "off"
    )
    assert code == 0 and r5["holdout"]["recomputed_eval_loss"] is None
    # Same requests, other batch neighbours and padding: equal up to fp32 summation order.
    for a, b in zip(scores, lls(r5)):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    assert r5["results"]["loom_tiny_mc"]["acc,none"] == r1["results"]["loom_tiny_mc"]["acc,none"]


def test_exit_scores_each_token_at_its_exit_loop_and_records_the_mean(
    trained_run, tmp_path, capsys
):
    from torchtitan_loom.components.evaluation.adaptive_exit import ExitRule, adaptive_logits

    args = ("--exit", "confidence", "--exit-threshold", "0.5", "--holdout-check", "off")
    code, res, _, err = run_eval(capsys, trained_run, tmp_path / "x", *args)
    assert code == 0, err
    ex = res["scoring"]["exit"]
    assert ex["criterion"] == "confidence" and ex["threshold"] == 0.5 and ex["decide_at"] is None
    assert 1.0 < ex["mean_loops"] < 3.0 and ex["scored_tokens"] > 0  # tokens exit at several loops
    # Each choice's score: the row run alone with its exits, read at each token's exit loop.
    loaded = load(str(trained_run))
    enc, rule = loaded.tokenizer.encode, ExitRule("confidence", 0.5, 3)
    doc = json.loads(open(os.path.join(TASKS_DIR, "loom_tiny_mc.jsonl")).readline())
    for choice, got in zip(doc["choices"], lls(res)[0]):
        ctx, cont = enc(doc["query"]), enc(choice)
        ids = torch.tensor([ctx + cont])[:, :-1]
        batch = {"input_ids": ids, "positions": torch.arange(ids.shape[1])[None]}
        batch["doc_ids"] = torch.zeros_like(ids)
        logp, _ = adaptive_logits(loaded.model, batch, rule)
        want = logp[0, len(ctx) - 1 :].gather(1, torch.tensor(cont)[:, None]).sum().item()
        assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_holdout_check_trips_on_perturbed_weights(trained_run, tmp_path, capsys):
    exp = tmp_path / "exp"
    assert export_tool.main([str(trained_run), str(exp)]) == 0
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    # Noise of half each tensor's std (the tiny model shrugs off less: 30% gives a gap of ~0.01).
    tensors = {
        k: v if "expert_bias" in k else v + 0.5 * v.std() * torch.randn(v.shape, generator=g)
        for k, v in load_file(str(exp / "model.safetensors")).items()
    }
    save_file(tensors, str(exp / "model.safetensors"))
    capsys.readouterr()
    code, _, _, err = run_eval(capsys, exp, tmp_path / "res")
    assert code == 2 and err.count("\n") == 1
    assert "holdout check failed" in err and "logged at step 40" in err
    assert not os.path.exists(tmp_path / "res")
    code, rec, _, _ = run_eval(capsys, exp, tmp_path / "res2", "--holdout-check", "record")
    assert code == 0 and rec["holdout"]["gap"] > 0.005
    code, _, _, err = run_eval(capsys, exp, tmp_path / "res3", "--holdout-threshold", "100")
    assert code == 0, err


def test_bad_input_exit_2(trained_run, tmp_path, capsys):
    cases = [
        (
            ["--tasks", "loom_tiny_mcq", "--tasks-dir", TASKS_DIR, "--only-tasks-dir"],
            "lm-eval knows no task 'loom_tiny_mcq'; did you mean loom_tiny_mc",
        ),
        ([*TASK, "--loops", "7"], "--loops 7: out of range; valid 1..6"),
        ([*TASK, "--tokenizer", "gpt2"], "does not match the pack"),
        ([*TASK, "--exit", "kl"], "--exit kl needs --exit-threshold X"),
        ([*TASK, "--exit-threshold", "0.1"], "--exit-threshold needs --exit kl, confidence"),
        ([*TASK, "--exit", "confidence", "--exit-threshold", "2"], "must be in [0, 1]"),
        (
            [*TASK, "--exit", "learned", "--exit-threshold", "0.02"],
            "--exit exit criterion learned: this checkpoint has no exit head",
        ),
    ]
    for extra, expected in cases:
        code = eval_tool.main([str(trained_run), *extra, "--out", str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and expected in err, err
    code = eval_tool.main([str(tmp_path / "missing"), *TASK])
    assert code == 2 and "no such file or directory" in capsys.readouterr().err


def test_two_ranks_split_requests_and_match_one_rank(trained_run, tmp_path, capsys):
    code, one, _, _ = run_eval(
        capsys, trained_run, tmp_path / "one", "--holdout-check", "off", "--loops", "2"
    )
    assert code == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "torchtitan_loom.tools.lm_eval",
            str(trained_run),
            *TASK,
            "--loops",
            "2",
            "--batch-size",
            "3",
            "--out",
            str(tmp_path / "two"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.load(open(glob.glob(str(tmp_path / "two" / "*" / "results.json"))[0]))
    assert two["scoring"]["world_size"] == 2
    # The holdout loss over two ranks equals the logged (one-rank-eval) value.
    assert two["holdout"]["gap"] <= 1e-6
    assert len(two["samples"]["loom_tiny_mc"]) == 12
    for a, b in zip(lls(one), lls(two)):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    assert two["results"]["loom_tiny_mc"]["acc,none"] == one["results"]["loom_tiny_mc"]["acc,none"]

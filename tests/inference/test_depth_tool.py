"""tools.depth on a trained checkpoint, and generate's depth flags: by default the report's
fixed-depth losses for loops 1..H equal the trainer's own held-out eval of the same step (logged
in metrics.jsonl); with capacity off and a --tokens override they equal the loop-by-loop pass over
that slice (an independent path: one forward per loop with the carry, no hold) and the report
names both differences; loops past H are measured under both policies, adaptive sweeps are
monotone in what they count, an exit on the fixed-depth curve is credited with nothing, the files
land under the run folder, an occupied output folder needs --force, and bad input is one line
with exit 2."""

import json
import os

import pytest
import torch

from torchtitan_loom.components.data import build_eval_loader
from torchtitan_loom.components.evaluation.loop_by_loop import LoopByLoop
from torchtitan_loom.tools import depth as depth_tool
from torchtitan_loom.tools import generate as gen_tool
from torchtitan_loom.tools.loading import load

FAST = ["--kl", "0,0.01,10", "--confidence", "0,0.5,1"]


@pytest.fixture(scope="module")
def report(trained_run):
    code = depth_tool.main([str(trained_run), *FAST])
    assert code == 0
    out = trained_run / "depth" / "step-40"
    return out, json.loads((out / "depth.json").read_text())


def test_default_report_equals_the_trainer_eval_of_the_same_step(report, trained_run):
    out, numbers = report
    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if r["step"] == 40 and "eval_loss" in r][-1]
    assert numbers["tokens"] == logged["eval_tokens"]
    for policy in ("last", "cycle"):
        got = [r["loss"] for r in numbers["fixed"][policy][:3]]
        assert got == pytest.approx([logged[f"eval_loss_loop_{t}"] for t in (1, 2, 3)], rel=1e-6)
    assert numbers["reads"]["differs"] == [] and numbers["reads"]["as_trained"].startswith(
        "capacity_factor = "
    )
    assert "Read as the run's held-out eval reads: " in (out / "depth.md").read_text()


def test_capacity_off_and_fewer_tokens_equal_the_loop_by_loop_pass_and_are_named(
    trained_run, tiny_pack, tmp_path, capsys
):
    out = tmp_path / "off"
    argv = [str(trained_run), "--tokens", "1200", "--capacity", "off", "--out", str(out)]
    assert depth_tool.main([*argv, "--kl", "0", "--confidence", "0"]) == 0
    console = capsys.readouterr().out
    numbers = json.loads((out / "depth.json").read_text())
    loaded = load(str(trained_run), need_tokenizer=False)  # capacity off, as the inference tools
    loader = build_eval_loader(
        str(tiny_pack),
        seq_len=numbers["seq_len"],
        vocab_size=loaded.args.vocab_size,
        batch_rows=4,  # the run's global batch: where its eval stops reading
        dp_rank=0,
        dp_world=1,
        max_tokens=1200,
    )
    sums = LoopByLoop(loaded.model, torch.device("cpu"))
    with torch.no_grad():
        for batch in loader:
            for lo in (0, 2):  # in the run's micro-batches of 2 rows, as the report runs them
                sums.add({k: v[lo : lo + 2] for k, v in batch.items()})
    want = (sums.ce_H / sums.n_tok).tolist()
    assert numbers["tokens"] == int(sums.n_tok)
    for policy in ("last", "cycle"):
        rows = numbers["fixed"][policy]
        assert [r["loops"] for r in rows] == [1, 2, 3, 4, 5, 6]
        assert [r["loss"] for r in rows[:3]] == pytest.approx(want, rel=1e-9)
    deeper = [r["loss"] for p in ("last", "cycle") for r in numbers["fixed"][p][3:]]
    assert all(x > 0 for x in deeper) and numbers["better_beyond"] in ("last", "cycle")
    assert (
        "unlike the run's held-out eval: --capacity off: the model as decoding runs it (trained "
        "with capacity_factor = 1.5); --tokens 1200 (eval.tokens = 1500)." in console
    )


def test_an_exit_on_the_fixed_curve_is_credited_with_nothing(report):
    _, numbers = report
    fixed, v = numbers["fixed"]["last"], numbers["verdict"]
    by = {(a["criterion"], a["threshold"]): a for a in numbers["adaptive"]}
    at_two = by[("kl", 10.0)]  # every token exits after loop 2: fixed depth 2 exactly
    assert at_two["loss"] == pytest.approx(fixed[1]["loss"], rel=1e-6)
    assert at_two["curve_loss_at_loops"] == pytest.approx(at_two["loss"], rel=1e-6)
    assert not at_two["below_curve"] and at_two["loops_saved"] == 0
    best = min(r["loss"] for r in fixed[:3])
    assert v["depth"] == min(r["loops"] for r in fixed[:3] if r["loss"] <= best * 1.01)
    for a in numbers["adaptive"]:  # credit only below the curve, within 1%, under depth d
        if a["loops_saved"]:
            assert a["below_curve"] and a["loss"] <= v["target_loss"]
            assert a["loops_saved"] == pytest.approx(v["depth"] - a["mean_loops"])
    if v["best"] is None:
        assert v["text"].startswith("no adaptive point beats the fixed-depth curve")
    else:
        assert f"fewer than fixed depth {v['depth']} " in v["text"]


def test_adaptive_points_span_from_one_exit_to_full_depth(report):
    out, numbers = report
    full = numbers["fixed"]["last"][2]["loss"]
    by = {(a["criterion"], a["threshold"]): a for a in numbers["adaptive"]}
    for criterion in ("kl", "confidence"):
        zero = by[(criterion, 0.0)]  # threshold 0: every token runs all H loops
        assert zero["mean_loops"] == 3.0 and zero["loss"] == pytest.approx(full, rel=1e-6)
        assert sum(zero["exits_after_loop"]) == numbers["tokens"]
    assert by[("kl", 10.0)]["mean_loops"] == 2.0  # KL is defined from loop 2: all exit there
    assert by[("confidence", 1.0)]["mean_loops"] == 1.0  # 1 - p_max < 1 always: all exit at 1
    assert by[("confidence", 1.0)]["loss"] == pytest.approx(
        numbers["fixed"]["last"][0]["loss"], rel=1e-6
    )
    assert "Verdict:" in (out / "depth.md").read_text()
    assert (out / "depth.png").read_bytes()[:4] == b"\x89PNG"


def test_an_occupied_folder_needs_force_and_bad_input_is_one_line(
    report, trained_run, tmp_path, capsys
):
    out, _ = report
    capsys.readouterr()
    cases = [
        ([str(trained_run), *FAST], "pass --force to replace"),
        ([str(trained_run), "--kl", "-1"], "--kl: kl threshold -1.0: must be a finite number ≥ 0"),
        ([str(trained_run), "--confidence", "2"], "must be in [0, 1]"),
        (
            [str(trained_run), "--learned", "0.5", "--out", str(tmp_path / "o")],
            "--learned: exit criterion learned: this checkpoint has no exit head",
        ),
        ([str(trained_run), "--beyond", "wrap"], "--beyond 'wrap': valid last, cycle"),
        ([str(trained_run), "--max-loops", "2"], "--max-loops 2: valid 3..12"),
        ([str(tmp_path / "none")], "no such file or directory"),
        (
            [str(trained_run), "--data", str(tmp_path), "--out", str(tmp_path / "o")],
            "held-out data",
        ),
    ]
    for argv, expected in cases:
        code = depth_tool.main(argv)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and expected in err, (argv, err)
    assert depth_tool.main([str(trained_run), *FAST, "--force", "--max-loops", "4"]) == 0
    assert len(json.loads((out / "depth.json").read_text())["fixed"]["last"]) == 4
    assert sorted(os.listdir(out)) == ["depth.json", "depth.md", "depth.png"]


def test_generate_adaptive_reports_mean_loops_and_zero_is_fixed_depth(report, trained_run, capsys):
    base = [
        str(trained_run),
        "--prompt",
        "the cat sat",
        "--temperature",
        "0",
        "--max-new-tokens",
        "8",
    ]
    assert gen_tool.main(base) == 0
    fixed = capsys.readouterr().out
    assert gen_tool.main([*base, "--exit", "kl", "--exit-threshold", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == fixed and "3.00 loops per token on average (at most 3; kl exit below 0" in err
    d = report[1]["verdict"]["depth"]  # the depth report of this step is in its default folder
    path = trained_run / "depth" / "step-40" / "depth.json"
    assert f"no fewer than fixed depth {d}, within 1% of the best fixed-depth loss ({path})" in err
    assert gen_tool.main([*base, "--exit", "confidence", "--exit-threshold", "1"]) == 0
    err = capsys.readouterr().err
    assert "1.00 loops per token on average" in err
    assert d == 1 or f"{d - 1:.2f} fewer than fixed depth {d}, within 1%" in err
    assert gen_tool.main([*base, "--loops", "6", "--beyond", "cycle"]) == 0  # past H
    assert capsys.readouterr().out.startswith("the cat sat")


def test_task_scores_after_each_loop_equal_an_independent_likelihood(trained_run, tmp_path):
    pytest.importorskip("lm_eval")
    import torch.nn.functional as F

    tasks_dir = os.path.join(os.path.dirname(__file__), "tiny_tasks")
    out = tmp_path / "tasks"
    argv = [
        str(trained_run),
        "--tokens",
        "300",
        "--kl",
        "0",
        "--confidence",
        "0",
        "--out",
        str(out),
    ]
    assert (
        depth_tool.main(
            [*argv, "--tasks", "loom_tiny_mc", "--tasks-dir", tasks_dir, "--only-tasks-dir"]
        )
        == 0
    )
    numbers = json.loads((out / "depth.json").read_text())
    rows = numbers["task_scores"]["by_loops"]
    assert [r["loops"] for r in rows] == [1, 2, 3, 4, 5, 6] and numbers["task_scores"][
        "policy"
    ] == "last"
    assert "| loops (past H: last) | loom_tiny_mc/acc |" in (out / "depth.md").read_text()

    loaded = load(str(trained_run))
    model, enc = loaded.model, loaded.tokenizer.encode
    model.set_beyond_policy("last")
    docs = [json.loads(line) for line in open(os.path.join(tasks_dir, "loom_tiny_mc.jsonl"))]

    def loglik(ctx, cont, loops):
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = model(
                ids[:, :-1],
                torch.arange(ids.shape[1] - 1)[None],
                torch.zeros_like(ids[:, :-1]),
                loop_end=loops,
            ).logits_BSV
        logp = F.log_softmax(logits[0, len(ctx) - 1 :], dim=-1)
        return logp.gather(1, torch.tensor(cont)[:, None]).sum().item()

    for row in rows:
        right = 0
        for doc in docs:
            s = [loglik(enc(doc["query"]), enc(c), row["loops"]) for c in doc["choices"]]
            right += max(range(len(s)), key=s.__getitem__) == doc["gold"]
        assert row["scores"]["downstream/loom_tiny_mc/acc"] == pytest.approx(right / len(docs))
    bad = [
        *argv,
        "--force",
        "--tasks",
        "no_such_task",
        "--tasks-dir",
        tasks_dir,
        "--only-tasks-dir",
    ]
    assert depth_tool.main(bad) == 2

"""Resume and start-up contracts of the trainer: the current config wins over the checkpoint's
optimizer values (LOOM_SPEC §7.7), and data.tokenizer is checked against the pack."""

import pytest
import torch

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.train import main
from torchtitan_loom.trainer import Trainer

CPU = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))


def argv(pack, dump, *extra):
    return [
        "--data.path",
        str(pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "2",
        "--training.micro_batch_size",
        "2",
        "--model.num_loops",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--eval.interval",
        "0",
        "--training.steps",
        "10",
        "--lr_scheduler.warmup_ratio",
        "0.5",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        *extra,
    ]


def test_config_wins_over_the_checkpoint_optimizer_values(tiny_pack, tmp_path, capsys):
    first = load_config(argv(tiny_pack, tmp_path, "--checkpoint.exit_after_step", "2"))
    assert Trainer(first, resolve(first, 1), CPU).train() == 0
    changed = (
        "--optimizer.lr",
        "5e-4",
        "--optimizer.beta2",
        "0.99",
        "--optimizer.eps",
        "1e-6",
        "--optimizer.weight_decay",
        "0.05",
    )
    cfg = load_config(argv(tiny_pack, tmp_path, *changed))
    trainer = Trainer(cfg, resolve(cfg, 1), CPU)
    capsys.readouterr()
    trainer.resume()
    group = trainer.optimizer.param_groups[0]
    assert trainer.state.step == 2 and trainer.optimizer.state  # a real resume, moments loaded
    assert (
        tuple(group["betas"]) == (0.9, 0.99)
        and group["eps"] == 1e-6
        and group["weight_decay"] == 0.05
    )
    # Step 3 of 10 with 5 warmup steps: lr = 5e-4 * 3/5, from the restored schedule position.
    assert group["lr"] == pytest.approx(5e-4 * 3 / 5, rel=1e-12)
    log = capsys.readouterr().out
    for line in (
        "optimizer.lr: checkpoint 0.003 -> config 0.0005",
        "optimizer.betas: checkpoint (0.9, 0.95) -> config (0.9, 0.99)",
        "optimizer.eps: checkpoint 1e-08 -> config 1e-06",
        "optimizer.weight_decay: checkpoint 0.1 -> config 0.05",
    ):
        assert f"resume: the config wins: {line}" in log
    # config.toml of the run folder says what runs.
    assert "lr = 0.0005" in (tmp_path / "config.toml").read_text()


def test_data_tokenizer_mismatch_is_one_line_and_exit_2(tiny_pack, tmp_path, capsys):
    code = main(argv(tiny_pack, tmp_path, "--data.tokenizer", "gpt2"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("data error: ") and "gpt2" in err[0], (
        err
    )
    assert (
        main(argv(tiny_pack, tmp_path / "ok", "--data.tokenizer", "byte", "--training.steps", "1"))
        == 0
    )


def test_extending_a_finished_run_says_what_happens_to_the_lr_schedule(tiny_pack, tmp_path, capsys):
    # 4 steps (2 warmup, then wsd decay to the end), then the same run raised to 8 steps.
    short = [a if a != "10" else "4" for a in argv(tiny_pack, tmp_path)]
    first = load_config(short)
    assert Trainer(first, resolve(first, 1), CPU).train() == 0
    cfg = load_config(argv(tiny_pack, tmp_path, "--training.steps", "8"))
    trainer = Trainer(cfg, resolve(cfg, 1), CPU)
    capsys.readouterr()
    trainer.resume()
    lines = [x for x in capsys.readouterr().out.splitlines() if "lr schedule" in x]
    assert len(lines) == 1, lines
    # Step 5 of 8 with 4 warmup steps: the peak again (the saved 4-step schedule had decayed to its floor).
    assert (
        "training.steps 4 → 8: the wsd lr schedule is recomputed over 8 steps, so step 5 runs at 1 ×"
        in lines[0]
    )
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.optimizer.lr)
    # A resume with the same total says nothing about the schedule.
    same = load_config(argv(tiny_pack, tmp_path / "other", "--checkpoint.exit_after_step", "2"))
    assert Trainer(same, resolve(same, 1), CPU).train() == 0
    relaunch = load_config(argv(tiny_pack, tmp_path / "other"))
    again = Trainer(relaunch, resolve(relaunch, 1), CPU)
    capsys.readouterr()
    again.resume()
    assert "lr schedule" not in capsys.readouterr().out

"""A checkpoint that does not fit the model (one clear error, nothing touched), model-only warm
start, and the export tool (round trip with --verify, same logits, tampering caught)."""

import os
import shutil

import pytest
import torch
from test_checkpoint import CPU, make_trainer, run  # tests/unit is on sys.path

from torchtitan_loom.components.checkpoint import CheckpointError, found, tree
from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.tools import export as export_tool
from torchtitan_loom.train import main
from torchtitan_loom.trainer import Trainer


@pytest.fixture(scope="module")
def trained(tiny_pack, tmp_path_factory):
    """A 2-step run (H = 3) with checkpoints at steps 1 and 2, and its trainer."""
    dump = tmp_path_factory.mktemp("trained")
    t = run(make_trainer(tiny_pack, dump, "--training.steps", "2", "--checkpoint.interval", "1"))
    return dump, t


def cli(tiny_pack, dump, *extra):
    return [
        "--data.path",
        str(tiny_pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--eval.interval",
        "0",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        *extra,
    ]


def snapshot_files(folder):
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(base, f)
            out[p] = (os.path.getsize(p), os.stat(p).st_mtime_ns)
    return out


def without_run_record(dump, tmp_path):
    """A copy of the run folder without run.json: a run from before run records, where only the
    checkpoint's own model check can tell that the config does not fit."""
    copy = tmp_path / "old_run"
    shutil.copytree(dump, copy, ignore=shutil.ignore_patterns("run.json", "RUN.lock"))
    return copy


def test_other_num_loops_is_one_config_error_listing_fields_and_shapes(
    trained, tiny_pack, tmp_path
):
    dump, _ = trained
    with pytest.raises(ConfigError, match=r"holds a different run \(model.num_loops: 3 → 4\)"):
        resolve(
            load_config(cli(tiny_pack, dump, "--model.num_loops", "4")), 1
        )  # the run record refuses first
    dump = without_run_record(dump, tmp_path)
    with pytest.raises(ConfigError) as exc:
        resolve(load_config(cli(tiny_pack, dump, "--model.num_loops", "4")), 1)
    msg = str(exc.value)
    assert msg.startswith(
        f"checkpoint {dump / 'checkpoint' / 'step-2'} (step 2) does not fit the configured model"
    )
    assert "model.num_loops: checkpoint 3, config 4" in msg
    assert "layers.0.moe.routers.3: checkpoint absent, this model [8, 128]" in msg
    assert "another job.dump_folder" in msg


def test_other_flavor_fails_before_anything_is_written(trained, tiny_pack, capsys, tmp_path):
    dump = without_run_record(trained[0], tmp_path)
    before = snapshot_files(dump)
    code = main(cli(tiny_pack, dump, "--model.flavor", "loom_329m", "--training.seq_len", "32"))
    err = capsys.readouterr().err
    assert code == 2
    assert (
        "config error: checkpoint" in err
        and "model.flavor: checkpoint 'debug', config 'loom_329m'" in err
    )
    assert (
        "layers.0.moe.expert_bias: checkpoint [8], this model [30]" in err
        and "... and 180 more" in err
    )
    assert snapshot_files(dump) == before


def test_manager_rejects_mismatched_shapes_even_past_validation(trained, tiny_pack, tmp_path):
    # Validation ran for other args; the trainer's own check (by tensor shape) still refuses.
    dump, _ = trained
    cfg = load_config(
        cli(tiny_pack, tmp_path, "--checkpoint.initial_load_path", str(dump / "checkpoint"))
    )
    resolved = resolve(cfg, 1)
    args = resolved._replace(model_args=resolved.model_args.replace(dim=64, n_heads=1))
    with pytest.raises(
        CheckpointError,
        match=r"(?s)warm start.*layers.0.attention.wo.weight: "
        r"checkpoint \[128, 128\], this model \[64, 64\]",
    ):
        Trainer(cfg, args, CPU).resume()


def test_load_step_that_does_not_exist(trained, tiny_pack):
    dump, _ = trained
    with pytest.raises(
        ConfigError,
        match=r"checkpoint.load_step = 7: no complete checkpoint .* complete steps: 1, 2",
    ):
        resolve(load_config(cli(tiny_pack, dump, "--checkpoint.load_step", "7")), 1)


def test_warm_start_loads_only_the_model_then_the_run_resumes_its_own(trained, tiny_pack, tmp_path):
    dump, src = trained
    t = make_trainer(
        tiny_pack,
        tmp_path,
        "--training.steps",
        "2",
        "--checkpoint.initial_load_path",
        str(dump / "checkpoint"),
    )
    for k, v in src.model.state_dict().items():
        assert torch.equal(t.model.state_dict()[k], v), k
    assert t.state.step == 0 and not t.optimizer.state and t.dataloader.state_dict()["cursor"] == 0
    run(t)
    again = make_trainer(
        tiny_pack,
        tmp_path,
        "--training.steps",
        "3",
        "--checkpoint.initial_load_path",
        str(dump / "checkpoint"),
    )
    assert again.state.step == 2  # its own checkpoint wins over the warm start


def test_export_round_trip_verify_and_same_logits(trained, tmp_path, capsys):
    dump, t = trained
    out = tmp_path / "export"
    assert export_tool.main([str(dump), str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("export: reading the model of ")  # before the slow part
    assert "verified: 28 tensors bit-identical" in printed
    info = tree.read_json(str(out / "model_args.json"))
    assert (
        info["name"] == "loom"
        and info["flavor"] == "debug"
        and info["step"] == 2
        and info["args"]["num_loops"] == 3
    )
    assert (out / "config.toml").exists()
    model = found.find(str(out)).build()
    batch = next(iter(t.dataloader))
    with torch.no_grad():
        want = t.model(batch["input_ids"], batch["positions"], batch["doc_ids"]).logits_BSV
        got = model(batch["input_ids"], batch["positions"], batch["doc_ids"]).logits_BSV
    assert torch.equal(got, want)


def test_bf16_export_keeps_buffers_fp32_and_verify_catches_tampering(trained, tmp_path):
    dump, _ = trained
    out = tmp_path / "bf16"
    ckpt = str(dump / "checkpoint" / "step-1")
    export_tool.export(ckpt, str(out), "bf16")
    assert export_tool.verify(ckpt, str(out)) == 28
    info, tensors = export_tool.read_export(str(out))
    assert tensors["output.weight"].dtype == torch.bfloat16
    assert tensors["layers.0.moe.expert_bias"].dtype == torch.float32
    from safetensors.torch import save_file

    tensors["layers.1.attention.wo.weight"].view(-1)[3] += 1.0
    save_file(tensors, str(out / info["file"]))
    with pytest.raises(
        export_tool.ExportError, match="layers.1.attention.wo.weight: values differ"
    ):
        export_tool.verify(ckpt, str(out))


def test_export_refuses_torn_and_foreign_input(trained, tmp_path):
    dump, _ = trained
    torn = tmp_path / "step-9"
    shutil.copytree(dump / "checkpoint" / "step-1", torn)
    os.remove(torn / tree.MARKER)
    assert export_tool.main([str(torn), str(tmp_path / "x")]) == 2
    assert export_tool.main([str(tmp_path / "nothing"), str(tmp_path / "y")]) == 2

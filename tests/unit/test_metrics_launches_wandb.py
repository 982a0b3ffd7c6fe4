"""TensorBoard: one sub-folder of tb/ per launch (a resumed run never interleaves with the earlier
event stream); wandb (offline): the run file holds the same scalars, under the same tags, as
TensorBoard."""

import glob
import json
import struct
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchtitan_loom.components.observability.metrics import MetricsLogger
from torchtitan_loom.config.schema import Metrics


def tb_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(folder)
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_each_launch_gets_its_own_tensorboard_folder(tmp_path):
    with MetricsLogger(str(tmp_path), Metrics()) as first:
        first.log(1, {"loss": 3.0})
        first.log(2, {"loss": 2.5})
    with MetricsLogger(
        str(tmp_path), Metrics()
    ) as resumed:  # same dump folder, same second is fine too
        resumed.log(2, {"loss": 2.375})
        resumed.log(3, {"loss": 2.0})
    launches = sorted(p for p in (tmp_path / "tb").iterdir())
    assert len(launches) == 2 and {str(p) for p in launches} == {first.tb_dir, resumed.tb_dir}
    assert tb_scalars(first.tb_dir) == {"train/loss": [(1, 3.0), (2, 2.5)]}
    assert tb_scalars(resumed.tb_dir) == {"train/loss": [(2, 2.375), (3, 2.0)]}


def wandb_history(run_file: str) -> list[dict]:
    """History rows of a .wandb run file (a LevelDB-style log of wandb_internal_pb2.Record messages:
    7-byte file header; per chunk crc32, length (u16), type (1 full, 2 first, 3 middle, 4 last); 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, i, buf, rows = open(run_file, "rb").read(), 7, b"", []
    while i + 7 <= len(data):
        if 32768 - i % 32768 < 7:  # a block's tail too short for a chunk header is padding
            i += 32768 - i % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[i : i + 7])
        buf += data[i + 7 : i + 7 + length]
        i += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            try:
                rec.ParseFromString(buf)
            except Exception:  # a record still being written: read again later
                break
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        (it.key or "/".join(it.nested_key)): json.loads(it.value_json)
                        for it in rec.history.item
                    }
                )
    return rows


def test_wandb_offline_logs_the_tensorboard_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "loom-test")
    with MetricsLogger(
        str(tmp_path), Metrics(enable_wandb=True), wandb_config={"training": {"steps": 2}}
    ) as logger:
        logger.log(1, {"loss": 3.5, "loss_segment_1": 3.75, "lr": 1e-3, "mfu": None})
        logger.log(2, {"loss": 3.0, "eval_loss": 3.25, "eval_loss_loop_1": 3.5})
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + 60  # wandb's service process may still be writing after finish()
    while len(rows := wandb_history(run_file)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    from_wandb: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for tag, value in row.items():
            if not tag.startswith("_"):
                from_wandb.setdefault(tag, []).append((row["_step"], value))
    tb = tb_scalars(logger.tb_dir)
    assert (
        from_wandb.keys()
        == tb.keys()
        == {"train/loss", "train/loss_segment_1", "train/lr", "eval/loss", "eval/loss_loop_1"}
    )
    for tag, points in tb.items():  # TensorBoard stores float32
        assert [s for s, _ in from_wandb[tag]] == [s for s, _ in points]
        assert [v for _, v in from_wandb[tag]] == pytest.approx([v for _, v in points], rel=1e-6)

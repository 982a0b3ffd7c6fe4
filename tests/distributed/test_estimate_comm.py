"""The dry run's predicted collectives (distributed/comm_plan.py) equal those a real step makes on
2 and 4 gloo ranks: calls and bytes of every all-gather, reduce-scatter, all-reduce and all-to-all,
for FSDP, plain replicas, HSDP, expert parallelism, both reshard_after_forward policies, both
fsdp_sync modes (where the trainer has the key), activation checkpointing, bf16 parameters and a
vocabulary FSDP must pad (514 rows over 4 ranks).

Exact equality, no tolerance: the counts follow from FSDP2's hooks and the step's structure. The one
quantity that depends on the data is the rows an expert-parallel rank receives (routing); the sum
over the ranks of what they receive equals the sum of what they send, so the all-to-all bytes are
compared summed over the ranks.
"""

import json

import estimate_workers  # next to this file (conftest puts it on sys.path for the spawned ranks)

from torchtitan_loom.config import load_config
from torchtitan_loom.config.schema import Parallelism
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed import comm_plan
from torchtitan_loom.protocols import get_train_spec

LAUNCH_TIMEOUT_S = 300.0
# FSDP's sync per segment or per micro-batch, where the trainer has the choice.
SYNC_MODES = (
    Parallelism.__dataclass_fields__["fsdp_sync"].metadata["choices"]
    if "fsdp_sync" in Parallelism.__dataclass_fields__
    else ()
)


def per_sync_mode(case: dict) -> list[dict]:
    """The case once per fsdp_sync mode (once when the key does not exist)."""
    if not SYNC_MODES:
        return [case]
    return [
        {"name": f"{case['name']}_{mode}", "argv": case["argv"] + ["--parallelism.fsdp_sync", mode]}
        for mode in SYNC_MODES
    ]


def base_argv(pack_dir) -> list[str]:
    return [
        "--data.path",
        str(pack_dir),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "8",
        "--model.num_loops",
        "6",
        "--training.bp_segment_len",
        "3",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.enable_tensorboard",
        "false",
        "--eval.interval",
        "0",
        "--spike_guard.enable",
        "false",
        "--training.steps",
        "4",
    ]


def predicted(argv: list[str], world: int) -> dict[str, tuple[int, int]]:
    cfg = load_config(argv)
    args, dims = resolve(cfg, world)
    cost = get_train_spec(cfg.model.name).cost_fn(args, dims, cfg)
    return comm_plan.totals(comm_plan.predict(cfg, cost, dims, args.num_loops))


def check(launch_ranks, world: int, cases: list[dict], pack_dir, tmp_path) -> None:
    spec = {"base": base_argv(pack_dir), "cases": cases, "out": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    launch_ranks(
        estimate_workers.run,
        world,
        (world, str(tmp_path / "store"), str(tmp_path / "spec.json")),
        LAUNCH_TIMEOUT_S,
        "collective counts",
    )
    for case in cases:
        want = predicted(
            spec["base"] + case["argv"] + ["--job.dump_folder", str(tmp_path / "p")], world
        )
        ranks = [
            json.loads((tmp_path / f"{case['name']}.{r}.json").read_text()) for r in range(world)
        ]
        for r, got in enumerate(ranks):
            assert not [k for k in got if k.startswith("other")], (
                f"{case['name']}: unpredicted kinds {got}"
            )
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                assert tuple(got.get(kind, (0, 0))) == want[kind], (
                    f"{case['name']} rank {r} {kind}: {got} vs {want}"
                )
            assert got.get("all_to_all", [0, 0])[0] == want["all_to_all"][0], (
                f"{case['name']} rank {r}: {got}"
            )
        sent = sum(got.get("all_to_all", [0, 0])[1] for got in ranks)
        assert sent == world * want["all_to_all"][1], (
            f"{case['name']}: all-to-all bytes {sent} vs {want}"
        )
    assert any(want[k][0] for k in comm_plan.KINDS)  # not vacuous


def test_predicted_collectives_on_2_ranks(tiny_pack, tmp_path, launch_ranks):
    check(
        launch_ranks,
        2,
        [
            *per_sync_mode({"name": "fsdp2", "argv": ["--training.micro_batch_size", "2"]}),
            *per_sync_mode(
                {
                    "name": "fsdp2_always_ac_loop_bf16",
                    "argv": [
                        "--training.micro_batch_size",
                        "2",
                        "--parallelism.fsdp_reshard_after_forward",
                        "always",
                        "--activation_checkpoint.mode",
                        "loop",
                        "--training.mixed_precision_param",
                        "bfloat16",
                    ],
                }
            ),
            {
                "name": "replicate2",
                "argv": ["--parallelism.dp_replicate", "2", "--training.micro_batch_size", "4"],
            },
        ],
        tiny_pack,
        tmp_path,
    )


def test_predicted_collectives_on_4_ranks(tiny_pack, tmp_path, launch_ranks):
    check(
        launch_ranks,
        4,
        [
            {
                "name": "ep2_ac_block",
                "argv": [
                    "--training.micro_batch_size",
                    "1",
                    "--parallelism.ep",
                    "2",
                    "--activation_checkpoint.mode",
                    "block",
                ],
            },
            *per_sync_mode(
                {
                    "name": "hsdp_ep2_bf16",
                    "argv": [
                        "--training.micro_batch_size",
                        "1",
                        "--parallelism.dp_replicate",
                        "2",
                        "--parallelism.ep",
                        "2",
                        "--training.mixed_precision_param",
                        "bfloat16",
                    ],
                }
            ),
            {
                "name": "fsdp4_padded_vocab",
                "argv": ["--training.micro_batch_size", "2", "--model.vocab_size", "514"],
            },
        ],
        tiny_pack,
        tmp_path,
    )

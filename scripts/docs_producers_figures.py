"""Producers of the figures the prose around the tables quotes: what the estimate and the cost model
give for a layout (FSDP traffic and memory per sync mode, flat FSDP at scale, capacity slots, the
score tensor flex attention avoids), the routing shape of the debug model, and the protocol's
surface on the contracts page. Every one is computed from this tree's code and presets, with no
run and no timing: cheap and deterministic, so CI reruns them and compares the text
(tests/unit/test_docs_fresh.py)."""

from __future__ import annotations

import ast
import json
import re

from docs_context import Context, prose
from docs_runner import ROOT

FACTS_CODE = r"""
import json, math
from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.estimate import estimate
from torchtitan_loom.models.loom.moe import expert_capacity
from torchtitan_loom.protocols import get_train_spec

GIB = float(1 << 30)
BIG = ['--job.config_file', 'train_configs/loom_1p7b.toml', '--parallelism.dry_run',
       '--parallelism.layout', 'degrees']  # the degrees as written: dp_shard = all ranks


def layout(world, *extra):
    cfg = load_config(BIG + list(extra))
    args, dims = resolve(cfg, world)
    cost = get_train_spec(cfg.model.name).cost_fn(args, dims, cfg)
    return cfg, args, dims, cost, estimate(cfg, args, dims, cost)


out = {}
for sync in ('micro_batch', 'segment'):
    cfg, args, dims, cost, est = layout(8, '--parallelism.fsdp_sync', sync)
    moved = {k: [0, 0.0] for k in ('all_gather', 'reduce_scatter')}
    for c in est.collectives:
        if c.kind in moved:
            moved[c.kind][0] += c.calls
            moved[c.kind][1] += c.calls * c.nbytes * (c.size - 1) / c.size
    t = cfg.training
    out[sync] = dict(
        moved=moved, total_gib=est.memory['total'] / GIB,
        gathered_gib=est.memory['gathered parameters'] / GIB,
        unsharded_gib=est.memory['unsharded gradient accumulation'] / GIB,
        values=sum(math.prod(s) for u in cost.units for s in u.shapes),
            )
cfg, args, dims, cost, est = layout(8, '--parallelism.ep', '2')
out['ep2'] = dict(
    values=sum(math.prod(s) for u in cost.units for s in u.shapes),
    unsharded_gib=est.memory['unsharded gradient accumulation'] / GIB,
    experts_per_rank=args.num_routed_experts // 2,
)
hw = cfg.estimate
t = cfg.training
n = t.micro_batch_size * t.seq_len
k, e = args.routed_top_k, args.num_routed_experts
c = expert_capacity(n, k, e, args.capacity_factor)
out['model'] = dict(
    L=args.n_layers, H=args.num_loops, E=e, k=k, f=args.capacity_factor, heads=args.n_heads,
    mb=t.micro_batch_size, seq=t.seq_len, N=n, C=c, slots=e * c, assignments=n * k,
    micro8=t.global_batch_size // 8 // t.micro_batch_size, K=t.bp_segment_len,
    intra=hw.intra_node_gbps, inter=hw.inter_node_gbps, node=hw.gpus_per_node,
    gpu_gib=hw.memory_gib,
)
dbg = load_config(['--job.config_file', 'train_configs/debug_model.toml', '--parallelism.dry_run'])  # no run folder read
da, _ = resolve(dbg, 1)
out['debug'] = dict(L=da.n_layers, H=da.num_loops, E=da.num_routed_experts, k=da.routed_top_k)
print(json.dumps(out))
"""


def _facts(ctx: Context) -> dict:
    return ctx.once(
        "layout-facts", lambda: json.loads(ctx.runner.python(FACTS_CODE).strip().splitlines()[-1])
    )


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.0f} GB"


def fsdp_sync_volume(ctx: Context) -> str:
    f = _facts(ctx)
    mb, sg, m, ep2 = f["micro_batch"], f["segment"], f["model"], f["ep2"]

    def traffic(d: dict) -> str:
        ag, rs = d["moved"]["all_gather"], d["moved"]["reduce_scatter"]
        return f"{ag[0]:,} all-gathers and {rs[0]:,} reduce-scatters, ≈ {_gb(ag[1] + rs[1])}"

    return prose(
        f"At `loom_1p7b` on 8 GPUs ({m['micro8']} micro-batches of {m['mb']} × {m['seq']} per rank "
        f"and segment, K = {m['K']}) the estimate's plan (`distributed/comm_plan.py`) moves per rank "
        f"and step: `micro_batch` {traffic(mb)}; `segment` {traffic(sg)}. **What it costs in "
        f"memory**, per rank: the unsharded fp32 gradient of every FSDP unit, held from a segment's "
        f"first backward to its last (routers excluded, they are replicated anyway): "
        f"{sg['values'] / 1e9:.2f} B values = {sg['unsharded_gib']:.2f} GiB without `ep`, "
        f"{ep2['values'] / 1e9:.2f} B values = {ep2['unsharded_gib']:.2f} GiB with `ep` 2 (each "
        f"rank holds {ep2['experts_per_rank']} of the {m['E']} experts). The gathered bf16 "
        f"parameters ({sg['gathered_gib']:.2f} GiB) cost nothing extra under "
        f"`reshard_after_forward = never`: they are all gathered at the end of every forward "
        f"anyway; they now also stay gathered through the backward. At 8 ranks the estimated peak "
        f"grows from {mb['total_gib']:.1f} to {sg['total_gib']:.1f} GiB (activations of one "
        f"micro-batch included), within the {m['gpu_gib']:g} GiB per GPU the estimate assumes, "
        f"hence the default.",
    )


def flat_fsdp_scaling(ctx: Context) -> str:
    m = _facts(ctx)["model"]
    return prose(
        f"Flat FSDP stops scaling as soon as it leaves the node: at 64 GPUs every gather crosses "
        f"the network ({m['inter']:g} GB/s instead of {m['intra']:g}), at 512 FSDP also pads each "
        f"{m['E']}-expert tensor to 512 rows ({512 / m['E']:.0f}× its size) in every gather. HSDP "
        f"keeps the gathers inside a node of {m['node']} and sends only the reduced shard (1/{m['node']}) "
        f"over the network; at 512 GPUs with "
        f"2 rows per rank (one micro-batch: both FSDP sync modes alike) the step is short and "
        f"communication-bound."
    )


def capacity_slots(ctx: Context) -> str:
    m = _facts(ctx)["model"]
    return prose(
        f"The padding does travel: E·C rows per rank and call, ≈ f·N·K = {m['f']:g} × the N·K rows "
        f"of the capacity-off dispatch (`loom_1p7b`, micro-batch {m['mb']} × {m['seq']}: "
        f"C = {m['C']:,}, {m['slots']:,} slot rows instead of {m['assignments']:,}), i.e. "
        f"{m['slots'] / m['assignments']:.1f} × the all-to-all bytes, traded for the "
        f"{m['L'] * m['H'] * m['micro8']:,} host syncs per step (L × H × micro-batches at 8 GPUs) "
        f'that stalled the host\'s launch-ahead. The per-expert loop (`moe_impl = "loop"`, or a '
        f"dtype the grouped GEMM cannot take) computes every slot, padding included: E·C rows, "
        f"{m['slots'] / m['assignments']:.1f} × the routed-expert FLOPs of dispatching all N·K "
        f"assignments at f = {m['f']:g}.",
    )


def flex_scores_size(ctx: Context) -> str:
    m = _facts(ctx)["model"]
    scores = m["mb"] * m["heads"] * m["seq"] ** 2 * 4
    return prose(
        f"On CUDA flex attention always runs compiled (`models/loom/flex_compiled.py`, one compiled "
        f"function per process, also with `compile.enable = false`): called uncompiled it would "
        f"compute the fp32 scores [B, H, S, S], {scores / 1e9:.2f} GB per layer and loop for "
        f"`loom_1p7b` at micro-batch {m['mb']} ({m['heads']} heads, S = {m['seq']}).",
    )


def debug_routing_shape(ctx: Context) -> str:
    d = _facts(ctx)["debug"]
    return prose(
        f"From the default run with checkpoints, analysed on the same held-out tokens as the run's "
        f"eval (the debug model has L = {d['L']}, H = {d['H']}, E = {d['E']}, k = {d['k']}, so a "
        f"token can visit {d['k']} … {min(d['E'], d['H'] * d['k'])} distinct experts):"
    )


# The contract between the trainer and a model: the protocols, and the cost a model reports to the
# dry run (model_cost.py, split from protocols.py for size), what a forward is asked for
# (loop_request.py).
CONTRACT_FILES = tuple(
    ROOT / "torchtitan_loom" / f for f in ("protocols.py", "loop_request.py", "model_cost.py")
)


def _first_sentence(doc: str | None) -> str:
    """The docstring's first sentence (a '. ' before a capital ends it), with reST ``code`` as
    markdown `code`."""
    text = " ".join((doc or "").split()).replace("``", "`")
    return re.split(r"\.\s+(?=[A-Z])", text)[0].rstrip(".")


def _members(cls: ast.ClassDef) -> list[tuple[str, str]]:
    """(name, first sentence of its docstring) of every public field and method, in source order."""
    out, body = [], cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            nxt = body[i + 1] if i + 1 < len(body) else None
            doc = (
                nxt.value.value
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                else None
            )
            out.append((node.target.id, _first_sentence(doc)))
        elif isinstance(node, ast.FunctionDef) and (
            not node.name.startswith("_") or node.name == "__call__"
        ):
            out.append((node.name, _first_sentence(ast.get_docstring(node))))
    return out


def protocol_surface(ctx: Context) -> str:
    """Every class and function of protocols.py, loop_request.py and model_cost.py with its members, each with the
    first sentence of its docstring: a table of contents of the contract, read from the files (no
    import)."""
    out = []
    nodes = [n for f in CONTRACT_FILES for n in ast.parse(f.read_text(encoding="utf-8")).body]
    for node in nodes:
        if isinstance(node, ast.ClassDef):
            out += [f"**`{node.name}`**: {_first_sentence(ast.get_docstring(node))}.", ""]
            out += [f"- `{m}`" + (f": {d}" if d else "") for m, d in _members(node)]
            out.append("")
        elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            out += [f"**`{node.name}()`**: {_first_sentence(ast.get_docstring(node))}.", ""]
    return "\n".join(out).rstrip("\n")

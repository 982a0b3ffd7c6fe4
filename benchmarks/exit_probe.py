"""Which exit decision could beat fixed depth on a trained checkpoint? An offline probe (issue 46).

    python benchmarks/exit_probe.py RUN [--tokens N] [--seed S]

Runs the checkpoint's held-out tokens (the pack's holdout, rows of the run's seq_len) loop by loop
to H and keeps, per token and loop, the CE, the normed stream and the prediction's entropy. The
first half of the tokens fits each decision rule, the second half measures it: a token exits after
the first loop whose score is below a threshold (the thresholds are the score's deciles), and its
loss is its CE at that loop, read from the fixed-depth pass. That ignores what an exit changes for
the tokens still looping (their keys and values of the exited token are held), so it is an
optimistic screen for choosing a design, not a measurement: tools.depth measures exits causally.

Rules: KL between successive loops (Huginn's zero-shot exit), the prediction's entropy, a linear
map of the stream trained on the sign of the next loop's CE drop (the first learned head), a
linear map trained on the drop itself, and a small MLP on [stream, entropy, loop / H] trained on
the drop with a Huber loss (the head models/loom/exit_head.py now has); also the oracle that
knows each token's drop of the next loop (an upper bound for any rule that decides one loop at a
time). Each row: mean loops, loss, the fixed loops of the same loss on the falling part of the
fixed-depth curve (tools/depth_verdict.loops_for_loss) and the share of them the rule does not run.

``--causal-first-loop`` measures instead a checkpoint's own trained head causally (the held keys
and values included, capacity as trained): stopping tokens after loop 1 too, against from loop 2
on, the rule adaptive_exit.FIRST_LEARNED_EXIT keeps.

Legend: N tokens, T loops, D model dim.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from torchtitan_loom.components.data import build_eval_loader, bundled_corpus_path
from torchtitan_loom.components.evaluation.loop_by_loop import each_loop
from torchtitan_loom.data_contract import IGNORE_INDEX
from torchtitan_loom.tools.depth_verdict import loops_for_loss
from torchtitan_loom.tools.loading import load

DECILES = [0.1 * k for k in range(1, 10)]


def held_out(loaded, tokens: int):
    """The pack's holdout in rows of the run's seq_len, 8 rows a batch, up to ``tokens``."""
    return build_eval_loader(
        str(loaded.pack_path or bundled_corpus_path(None)),
        seq_len=loaded.config.training.seq_len if loaded.config else 256,
        vocab_size=loaded.args.vocab_size,
        batch_rows=8,
        dp_rank=0,
        dp_world=1,
        val_path=None,
        max_tokens=tokens,
    )


@torch.no_grad()
def collect(run: str, tokens: int) -> dict[str, torch.Tensor]:
    """Per held-out token and loop 1..H: "ce" [N, T] fp64, "z" the normed stream [N, T, D],
    "entropy" [N, T] and "kl" [N, T] (KL(p_t || p_{t-1}); +inf at loop 1)."""
    loaded = load(run, need_tokenizer=False)
    model, H = loaded.model, loaded.model.num_loops
    loader = held_out(loaded, tokens)
    kept: dict[str, list[torch.Tensor]] = {"ce": [], "z": [], "entropy": [], "kl": []}
    for mb in loader:
        valid_BS = mb["labels"] != IGNORE_INDEX
        target_BS1 = mb["labels"].clamp_min(0)[..., None]
        loops: dict[str, list[torch.Tensor]] = {k: [] for k in kept}
        prev = None
        for _, out in each_loop(model, mb, range(1, H + 1)):
            logp_BSV = F.log_softmax(out.logits_BSV.float(), dim=-1)
            p_BSV = logp_BSV.exp()
            loops["ce"].append(-logp_BSV.gather(-1, target_BS1)[..., 0][valid_BS])
            loops["z"].append(out.carry.z_BSD[valid_BS].float())
            loops["entropy"].append(-(p_BSV * logp_BSV).sum(-1)[valid_BS])
            kl_BS = (
                torch.full(valid_BS.shape, float("inf"))
                if prev is None
                else (p_BSV * (logp_BSV - prev)).sum(-1)
            )
            loops["kl"].append(kl_BS[valid_BS])
            prev = logp_BSV
        for k, v in loops.items():
            kept[k].append(torch.stack(v, 1))
    out = {k: torch.cat(v) for k, v in kept.items()}
    out["ce"] = out["ce"].double()
    return out


def curve(ce_NT: torch.Tensor, score_NT: torch.Tensor) -> list[tuple[float, float]]:
    """(mean loops, loss) of exiting after the first loop < threshold, at the score's deciles."""
    N, T = ce_NT.shape
    inner = score_NT[:, : T - 1].float()
    finite = inner[torch.isfinite(inner)]
    points = []
    for q in torch.quantile(finite, torch.tensor(DECILES)).tolist():
        stop_NT = torch.cat([inner < q, torch.ones(N, 1, dtype=torch.bool)], 1)
        t_N = stop_NT.float().argmax(1)
        points.append(
            ((t_N + 1).double().mean().item(), ce_NT.gather(1, t_N[:, None]).mean().item())
        )
    return points


def fit_linear(x_MF: torch.Tensor, y_M: torch.Tensor, sign: bool) -> torch.Tensor:
    """Weights [F + 1] of a linear map with a bias: least squares on y, or logistic on y > 0."""
    x = torch.cat([x_MF.double(), torch.ones(len(x_MF), 1, dtype=torch.float64)], 1)
    if not sign:
        return torch.linalg.lstsq(x, y_M[:, None].double()).solution[:, 0]
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200)

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w, (y_M > 0).double())
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def fit_mlp(x_MF: torch.Tensor, y_M: torch.Tensor, seed: int, epochs: int = 10) -> torch.nn.Module:
    """The head's shape (exit_head.HIDDEN wide, GELU), Huber loss on the drop, Adam."""
    from torchtitan_loom.models.loom.exit_head import HIDDEN

    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(x_MF.shape[1], HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, 1)
    )
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    for _ in range(epochs):
        for idx in torch.randperm(len(x_MF)).split(1024):
            loss = F.huber_loss(net(x_MF[idx])[:, 0], y_M[idx].float(), delta=1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net


@torch.no_grad()
def causal_first_loop(run: str, tokens: int) -> None:
    """On a checkpoint with the exit head: its exits measured causally (adaptive_pass, the held
    keys and values included, the run's capacity as trained) when the head may stop a token after
    loop 1 too, and from loop 2 on (adaptive_exit.FIRST_LEARNED_EXIT), against fixed depths on
    the same tokens (every token stopped at loop t)."""
    from torchtitan_loom.components.evaluation.adaptive_exit import adaptive_pass
    from torchtitan_loom.tools.depth_run import as_trained

    loaded = load(run, need_tokenizer=False)
    model, H = as_trained(loaded), loaded.model.num_loops
    batches = list(held_out(loaded, tokens))

    def measure(threshold: float, max_loops: int, decide_at: frozenset[int]) -> tuple[float, float]:
        ce = loops = n = 0.0
        for mb in batches:
            got = adaptive_pass(model, mb, "learned", threshold, max_loops, decide_at)
            ce, loops, n = ce + got.ce_sum, loops + got.loops_sum, n + got.tokens
        return loops / n, ce / n

    fixed = [{"loops": t, "loss": measure(1e9, t, frozenset({t}))[1]} for t in range(1, H + 1)]
    best = min(fixed, key=lambda r: r["loss"])["loops"]
    print(
        "causal, held keys and values: fixed depth " + " / ".join(f"{r['loss']:.4f}" for r in fixed)
    )
    print("| head decides after | threshold | mean loops | loss | fixed loops, same loss | fewer |")
    print("|---|---|---|---|---|---|")
    for first in (1, 2):
        decide_at = frozenset(range(first, H))
        for threshold in (0.003, 0.01, 0.03, 0.1):
            loops, loss = measure(threshold, H, decide_at)
            equal = loops_for_loss(fixed, best, loss)
            same = "—" if equal is None else f"{equal:.2f}"
            fewer = "—" if equal is None else f"{1 - loops / equal:+.0%}"
            print(
                f"| loops {first}..{H - 1} | {threshold:g} | {loops:.2f} | {loss:.4f} | {same} | {fewer} |"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run folder with a checkpoint (any H)")
    p.add_argument(
        "--tokens", type=int, default=100_000, help="held-out tokens (half fit, half test)"
    )
    p.add_argument("--seed", type=int, default=0, help="the MLP's init and batch order")
    p.add_argument(
        "--causal-first-loop",
        action="store_true",
        help="instead: the checkpoint's own exit head, measured causally, deciding from loop 1 "
        "and from loop 2",
    )
    ns = p.parse_args()
    start = time.monotonic()
    if ns.causal_first_loop:
        causal_first_loop(ns.run, ns.tokens)
        print(f"({time.monotonic() - start:.0f} s)")
        return
    got = collect(ns.run, ns.tokens)
    ce_NT, z_NTD, ent_NT, kl_NT = got["ce"], got["z"], got["entropy"], got["kl"].double()
    N, T = ce_NT.shape
    fit, test = torch.arange(N // 2), torch.arange(N // 2, N)
    drop_NT = torch.cat([ce_NT[:, :-1] - ce_NT[:, 1:], torch.zeros(N, 1, dtype=torch.float64)], 1)
    depth_NT1 = (torch.arange(1, T + 1, dtype=torch.float32) / T).expand(N, T)[..., None]
    feats_NTF = torch.cat([z_NTD, ent_NT[..., None].float(), depth_NT1], -1)

    def rows(x_NTF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x_NTF[fit, : T - 1].reshape(-1, x_NTF.shape[-1]), drop_NT[fit, : T - 1].reshape(-1)

    def linear(x_NTF: torch.Tensor, sign: bool) -> torch.Tensor:
        w = fit_linear(*rows(x_NTF), sign=sign)
        return torch.cat([x_NTF.double(), torch.ones(N, T, 1, dtype=torch.float64)], -1) @ w

    mlp = fit_mlp(*rows(feats_NTF), seed=ns.seed)
    with torch.no_grad():
        mlp_NT = mlp(feats_NTF)[..., 0].double()
    rules = {
        "kl (zero-shot)": kl_NT,
        "entropy": ent_NT.double(),
        "linear z, sign of the drop": linear(z_NTD, sign=True),
        "linear z, the drop": linear(z_NTD, sign=False),
        "MLP [z, entropy, loop/H], the drop": mlp_NT,
        "oracle: the next loop's drop": drop_NT,
    }
    fixed = [{"loops": t + 1, "loss": x} for t, x in enumerate(ce_NT[test].mean(0).tolist())]
    best = min(fixed, key=lambda r: r["loss"])["loops"]
    print(
        f"{N:,} held-out tokens of {ns.run}, H = {T}; fitted on {len(fit):,}, measured on the rest"
    )
    print("fixed depth: " + " / ".join(f"{r['loss']:.4f}" for r in fixed) + f" (best: {best})")
    print("| rule | mean loops at the score's deciles | loss | fixed loops, same loss | fewer |")
    print("|---|---|---|---|---|")
    for name, score in rules.items():
        for loops, loss in curve(ce_NT[test], score[test]):
            equal = loops_for_loss(fixed, best, loss)
            fewer = "—" if equal is None else f"{1 - loops / equal:+.0%}"
            same = "—" if equal is None else f"{equal:.2f}"
            print(f"| {name} | {loops:.2f} | {loss:.4f} | {same} | {fewer} |")
    print(f"({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()

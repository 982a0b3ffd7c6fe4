"""An lm-eval (``lm-eval`` on PyPI, 0.4.x) model backed by a loaded LOOM checkpoint.

    loglikelihood          sum of log p(continuation | context) and whether greedy decoding
                           would produce the continuation, batched (right padding);
    loglikelihood_rolling  the whole-string log-likelihood over disjoint windows of max_seq_len;
    generate_until         incremental decoding (components/evaluation/sampling.py) cut at the first stop string.

Capacity dropping is off (the loader builds the model so), hence every request's score depends
only on its own tokens, not on which other requests share its batch. With an exit rule
(``--exit`` of tools.lm_eval) each token is scored from its exit loop's prediction, the whole
sequence run once with the exits (adaptive_exit.adaptive_logits), which is what decoding with the
same exits gives; still per row, so still independent of the batch. With several ranks
(torchrun), lm-eval gives each rank its share of the requests and gathers the metrics through
``all_gather`` / ``gather_object`` below.

Legend: B requests in a batch, S padded length, V vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from torchtitan_loom.components.data.tokenizer import Tokenizer
from torchtitan_loom.components.evaluation.adaptive_exit import ExitRule, adaptive_logits
from torchtitan_loom.components.evaluation.sampling import SamplingConfig, generate
from torchtitan_loom.protocols import ModelProtocol


class ScoringStopped(Exception):
    """A stop signal arrived while scoring (``should_stop``): the scores of this round are dropped."""


class LoomLM(LM):
    """lm-eval's LM interface over a LOOM model running loops [1, loops], or with per-token exit
    (``exit_rule``, adaptive_exit.ExitRule: each token scored and generated at its exit loop)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        device: torch.device,
        loops: int,
        batch_size: int = 8,
        max_gen_toks: int = 256,
        split_over_ranks: bool = True,
        should_stop: Callable[[], bool] | None = None,
        forward_context: Callable[[], Any] | None = None,
        exit_rule: ExitRule | None = None,
    ) -> None:
        """split_over_ranks=False: every rank scores every request (a sharded model needs every rank
        in every forward). should_stop() is asked before every batch; true raises ScoringStopped.
        forward_context() wraps every forward (the trainer's autocast)."""
        super().__init__()
        self.model, self.tok, self._device, self.loops = model, tokenizer, device, loops
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.max_len: int = cast(ModelProtocol, model).args.max_seq_len
        self.should_stop = should_stop or (lambda: False)
        self.forward_context = forward_context or contextlib.nullcontext
        self.exit_rule = exit_rule
        # Loops run by the scored continuation tokens (exit_rule only): their mean is reported.
        self.exit_loops_sum, self.exit_tokens = 0, 0
        if split_over_ranks and dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name_or_path

    # ------------------------------------------------------------------ collectives
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst=0):
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # ------------------------------------------------------------------ scoring
    def _check_stop(self) -> None:
        if self.should_stop():
            raise ScoringStopped

    def _pair_tokens(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Trailing spaces of the context belong to the continuation (as the word-initial space of
        # a BPE token would); an empty context is replaced by the end-of-text token.
        stripped = context.rstrip()
        continuation = context[len(stripped) :] + continuation
        ctx = self.tok.encode(stripped) if stripped else [self.tok.eos_id]
        return ctx, self.tok.encode(continuation)

    @torch.no_grad()
    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(cont | ctx), greedy match) per (context ids, continuation ids) pair, in order."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        # Longest first, so a batch pads little; the order does not change any score.
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        for start in range(0, len(order), self.batch_size):
            self._check_stop()
            idx = order[start : start + self.batch_size]
            inputs, targets = [], []
            for i in idx:
                ctx, cont = pairs[i]
                full = (ctx + cont)[-(self.max_len + 1) :]  # left-truncate to the model's window
                inputs.append(full[:-1])
                targets.append(full[len(full) - min(len(cont), len(full) - 1) :])
            S = max(len(x) for x in inputs)
            tokens_BS = torch.zeros(len(idx), S, dtype=torch.long)
            doc_BS = torch.full(
                (len(idx), S), -1, dtype=torch.long
            )  # -1 = padding (the model's convention)
            for b, x in enumerate(inputs):
                tokens_BS[b, : len(x)] = torch.tensor(x)
                doc_BS[b, : len(x)] = 0
            tokens_BS, doc_BS = tokens_BS.to(self._device), doc_BS.to(self._device)
            positions_BS = torch.arange(S, device=self._device).expand_as(tokens_BS)
            # One document per row; the padding after it is never seen by the real tokens (causal).
            with self.forward_context():
                if self.exit_rule is None:
                    out = self.model(tokens_BS, positions_BS, doc_BS, loop_end=self.loops)
                    logp_BSV = F.log_softmax(out.logits_BSV.float(), dim=-1)
                else:
                    batch = {"input_ids": tokens_BS, "positions": positions_BS, "doc_ids": doc_BS}
                    logp_BSV, loop_BS = adaptive_logits(self.model, batch, self.exit_rule)
                    for b in range(len(idx)):
                        n, length = len(targets[b]), len(inputs[b])
                        self.exit_loops_sum += int(loop_BS[b, length - n : length].sum())
                        self.exit_tokens += n
            for b, i in enumerate(idx):
                n, length = len(targets[b]), len(inputs[b])
                if n == 0:
                    results[i] = (0.0, True)
                    continue
                target = torch.tensor(targets[b], device=self._device)
                logp_NV = logp_BSV[b, length - n : length]
                ll = logp_NV.gather(1, target[:, None]).sum().item()
                results[i] = (ll, bool((logp_NV.argmax(-1) == target).all()))
        return results  # type: ignore[return-value]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._pair_tokens(*req.args) for req in requests]
        return self.score_tokens(pairs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            ids = self.tok.encode(req.args[0])
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=ids,
                    prefix_token=self.tok.eos_id,
                    max_seq_len=self.max_len,
                    context_len=1,
                )
            ]
            out.append(sum(ll for ll, _ in self.score_tokens(windows)))
        return out

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            self._check_stop()
            context, kwargs = req.args[0], dict(req.args[1] or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = (
                float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            )
            ids = self.tok.encode(context) or [self.tok.eos_id]
            max_new = min(max_new, self.max_len - 1)
            ids = ids[-(self.max_len - max_new) :]  # keep the end of an over-long context
            rule = self.exit_rule
            cfg = SamplingConfig(
                max_new_tokens=max_new,
                temperature=temperature,
                seed=int(kwargs.pop("seed", 0) or 0),
                exit_criterion=None if rule is None else rule.criterion,
                exit_threshold=0.0 if rule is None else rule.threshold,
                exit_loops=None if rule is None else rule.decide_at,
            )
            new = generate(
                self.model,
                torch.tensor([ids], device=self._device),
                cfg,
                loops=self.loops,
                eos_id=self.tok.eos_id,
            )[0].tolist()
            text = self.tok.decode([t for t in new if t != self.tok.eos_id])
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out

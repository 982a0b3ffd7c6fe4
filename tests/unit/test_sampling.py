"""Incremental decoding through the model's one forward: the KV cache per (layer, loop) gives the
same tokens and logits as recomputing the whole prefix every step; sampling filters."""

import pytest
import torch

from torchtitan_loom.components.evaluation.sampling import SamplingConfig, generate, next_token
from torchtitan_loom.loop_request import LoopRequest
from torchtitan_loom.models.loom import LoomTransformer, loom_flavors
from torchtitan_loom.models.loom.attention import KVCache


def model_for_decoding(**changes) -> LoomTransformer:
    model = LoomTransformer(loom_flavors["debug"].replace(capacity_factor=0, **changes))
    model.init_weights()
    with torch.no_grad():  # a non-zero expert bias, as after training, so routing uses it
        for i, moe in enumerate(model.moe_layers()):
            moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, moe.num_experts) * (i + 1))
    return model.eval()


def greedy_by_recompute(model, prompt, steps, loops=None):
    """Reference: the full forward over the whole prefix at every step, no cache."""
    seq, logits = prompt, []
    for _ in range(steps):
        S = seq.shape[1]
        out = model(seq, torch.arange(S).expand_as(seq), torch.zeros_like(seq), loop_end=loops)
        logits.append(out.logits_BSV[:, -1])
        seq = torch.cat([seq, out.logits_BSV[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.shape[1] :], torch.stack(logits, 1)


@pytest.mark.parametrize("loops", [None, 2])
def test_cached_greedy_equals_recomputing_the_prefix(loops):
    model = model_for_decoding()
    prompt = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_tokens, ref_logits = greedy_by_recompute(model, prompt, 12, loops)
        tokens = generate(
            model, prompt, SamplingConfig(max_new_tokens=12, temperature=0), loops=loops
        )
    assert torch.equal(tokens, ref_tokens)
    assert len(set(tokens[0].tolist())) > 1  # not a degenerate repeat of one token


def test_cached_step_logits_match_the_full_forward():
    """Prefill 5, then one position at a time: every step's logits equal the full forward's at that
    position (fp32; only the summation order of attention over the cached keys differs)."""
    model = model_for_decoding()
    seq = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(11).expand_as(seq)
    with torch.no_grad():
        full = model(seq, pos, torch.zeros_like(seq)).logits_BSV
        cache = KVCache()
        parts = [
            model(
                seq[:, :5],
                pos[:, :5],
                torch.zeros_like(seq[:, :5]),
                request=LoopRequest(cache=cache),
            ).logits_BSV
        ]
        for i in range(5, 11):
            parts.append(
                model(
                    seq[:, i : i + 1],
                    pos[:, i : i + 1],
                    torch.zeros_like(seq[:, :1]),
                    request=LoopRequest(cache=cache),
                ).logits_BSV
            )
    cached = torch.cat(parts, dim=1)
    assert cache.past_len() == 11
    assert set(cache.kv) == {(layer, loop) for layer in range(2) for loop in (1, 2, 3)}
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5 * full.abs().max().item())


def test_cache_refuses_capacity_and_overlong_input():
    capped = LoomTransformer(loom_flavors["debug"])
    capped.init_weights()
    with pytest.raises(ValueError, match="capacity"):
        generate(capped, torch.zeros(1, 3, dtype=torch.long), SamplingConfig(max_new_tokens=1))
    model = model_for_decoding(max_seq_len=8)
    cache = KVCache()
    x = torch.zeros(1, 6, dtype=torch.long)
    with torch.no_grad():
        model(x, torch.arange(6)[None], x, request=LoopRequest(cache=cache))
        with pytest.raises(ValueError, match="max_seq_len=8"):
            model(x[:, :3], torch.arange(6, 9)[None], x[:, :3], request=LoopRequest(cache=cache))


def test_generate_stops_at_max_seq_len_and_eos():
    model = model_for_decoding(max_seq_len=10)
    prompt = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(2))
    out = generate(model, prompt, SamplingConfig(max_new_tokens=50, temperature=0))
    assert out.shape == (1, 4)  # 6 + 4 = max_seq_len
    first = int(out[0, 0])
    stopped = generate(
        model, prompt, SamplingConfig(max_new_tokens=50, temperature=0), eos_id=first
    )
    assert stopped.tolist() == [[first]]


def test_sampling_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 2000)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(
        next_token(logits, SamplingConfig(temperature=1.0, top_k=1), g),
        torch.zeros(2000, dtype=torch.long),
    )
    top2 = next_token(logits, SamplingConfig(temperature=1.0, top_k=2), g)
    assert set(top2.tolist()) == {0, 1}
    # softmax = [0.61, 0.22, 0.14, 0.02]: top_p 0.7 keeps the first two (0.61 < 0.7 <= 0.83).
    nucleus = next_token(logits, SamplingConfig(temperature=1.0, top_p=0.7), g)
    assert set(nucleus.tolist()) == {0, 1}
    full = next_token(logits, SamplingConfig(temperature=1.0), g)
    assert set(full.tolist()) == {0, 1, 2, 3}
    share0 = (full == 0).float().mean().item()
    assert abs(share0 - logits[0].softmax(-1)[0].item()) < 0.04

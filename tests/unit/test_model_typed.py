"""The model's loop typed (issue 44 item 3), held on the source and on a call: the forward takes its
optional modes as one LoopRequest (no flag keywords), and no function of the model takes more than
MAX_POSITIONAL positional parameters (what goes further is keyword-only, so every call names it),
except what EXCEPTIONS declares with its reason (each still needed). That the decode cache and the
exit hold conform to their shared protocol is checked by mypy (model.py returns them as the
protocol's types).
"""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import torchtitan_loom
from torchtitan_loom.loop_request import LoopRequest
from torchtitan_loom.models.loom import LoomTransformer, loom_flavors

MODEL_DIR = Path(torchtitan_loom.__file__).parent / "models" / "loom"
MAX_POSITIONAL = 5  # self / cls / ctx (autograd functions) not counted
EXCEPTIONS = {
    "moe.py::gemm_path": "issue 44 item 4 moves the experts' dispatch (another change owns moe.py)",
    "moe.py::run_experts": "issue 44 item 4 moves the experts' dispatch (another change owns moe.py)",
}


def positional_breaches(root: Path) -> dict[str, int]:
    """``file::function`` -> its positional parameters, for every function over MAX_POSITIONAL."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
                n = len([a for a in names if a not in ("self", "cls", "ctx")])
                if n > MAX_POSITIONAL:
                    found[f"{path.relative_to(root).as_posix()}::{node.name}"] = n
    return found


def test_no_model_function_takes_more_than_a_handful_of_positional_parameters():
    over = {k: v for k, v in positional_breaches(MODEL_DIR).items() if k not in EXCEPTIONS}
    assert over == {}, f"make the rest keyword-only or pass a named value: {over}"


def test_every_declared_exception_is_still_needed():
    stale = sorted(set(EXCEPTIONS) - set(positional_breaches(MODEL_DIR)))
    assert stale == [], f"within the limit now (or gone): remove from EXCEPTIONS: {stale}"


def test_the_positional_scan_counts_what_it_says(tmp_path):
    (tmp_path / "m.py").write_text(
        "def f(a, b, c, d, e, g):\n    pass\n"
        "def k(a, b, c, d, e, *, g):\n    pass\n"
        "class A:\n    def m(self, a, b, c, d, e):\n        pass\n"
    )
    assert positional_breaches(tmp_path) == {"m.py::f": 6}


def test_the_forward_takes_its_modes_as_one_request():
    params = inspect.signature(LoomTransformer.forward).parameters
    modes = {f.name for f in dataclasses.fields(LoopRequest)}
    assert modes == {"return_topk", "observe", "cache", "hold"}
    assert modes.isdisjoint(params)
    assert params["request"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["carry"].kind is inspect.Parameter.KEYWORD_ONLY

    torch.manual_seed(0)
    model = LoomTransformer(loom_flavors["debug"])
    model.init_weights()
    tokens_BS = torch.randint(0, model.args.vocab_size, (1, 8))
    positions_BS, doc_ids_BS = torch.arange(8)[None], torch.zeros_like(tokens_BS)
    with torch.no_grad():
        plain = model(tokens_BS, positions_BS, doc_ids_BS)
        asked = model(
            tokens_BS,
            positions_BS,
            doc_ids_BS,
            request=LoopRequest(return_topk=True, observe=lambda x: x.float().mean()[None]),
        )
        with pytest.raises(TypeError):
            model(tokens_BS, positions_BS, doc_ids_BS, return_topk=True)
    assert plain.topk_LTBSK is None and plain.observed_LTNK is None
    L, H, K = model.args.n_layers, model.num_loops, model.args.routed_top_k
    assert asked.topk_LTBSK is not None and asked.topk_LTBSK.shape == (L, H, 1, 8, K)
    assert asked.observed_LTNK is not None and asked.observed_LTNK.shape == (L, H, 2, 1)
    assert torch.equal(plain.logits_BSV, asked.logits_BSV)  # asking changes no number

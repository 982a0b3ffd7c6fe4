"""Shared fixtures: a tiny byte-level pack that trainer tests read like the real corpus."""

import os

import numpy as np
import pytest

# Tests must not depend on (or fill) the user's home cache.
os.environ.setdefault(
    "TORCHTITAN_LOOM_CACHE",
    os.path.join(os.path.dirname(__file__), "..", ".cache", "torchtitan_loom"),
)


@pytest.fixture(scope="session")
def tiny_pack(tmp_path_factory):
    """~40k byte tokens of structured text, records of at most 33 tokens (so seq_len 32)."""
    from torchtitan_loom.components.data.pack_writer import PackWriter

    out = tmp_path_factory.mktemp("packs") / "tiny"
    rng = np.random.default_rng(0)
    info = {"vocab_size": 258, "name_or_path": "byte", "eos_token_id": 256}
    with PackWriter(out, info, max_seq_len=33) as w:
        for i in range(1500):
            a, b = int(rng.integers(0, 50)), int(rng.integers(0, 50))
            text = (
                f"{a}+{b}={a + b}."
                if i % 2
                else "the cat sat on the mat " * int(rng.integers(1, 3))
            )
            w.add_document(np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64))
        w.finish(epochs=2, holdout_tokens=2000, seed=0)
    return out


@pytest.fixture(scope="session")
def launch_cost_s():
    """Seconds a bare 2-rank launch takes on this machine now (tests/launch_cost.py), measured once
    per session when a multi-process test first asks: their time limits are multiples of it."""
    from tests import launch_cost

    return launch_cost.measure()


@pytest.fixture
def outside(tmp_path):
    """A checksummed folder outside the run (tests/untouched.py); a fault test plants its links into
    it and ends with ``outside.check()``."""
    from tests.untouched import Untouched

    return Untouched(tmp_path / "outside")

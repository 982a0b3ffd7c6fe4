"""Bundled synthetic corpus: deterministic, built once, safe under concurrent first use."""

import json
import random
import threading

import pytest

from torchtitan_loom.components.data import build_train_loader, bundled_corpus_path, open_pack
from torchtitan_loom.components.data import synthetic_corpus as sc
from torchtitan_loom.components.data.bundled import ensure_built


def test_generator_is_deterministic_and_tasks_are_correct():
    a = list(sc.generate_documents(seed=3, target_bytes=20_000))
    assert a == list(sc.generate_documents(seed=3, target_bytes=20_000))
    assert a != list(sc.generate_documents(seed=4, target_bytes=20_000))
    assert 20_000 <= sum(map(len, a)) < 21_000
    titles = {d.split(":\n")[0] for d in a}
    assert titles == {t for t, _, _ in sc.TASKS}
    rng = random.Random(0)
    for _ in range(200):  # the answers the model is asked to learn are actually right
        line = sc.var_chain(rng)
        defs, query = line.rsplit("; ", 1)
        env = {}
        for d in defs.split("; "):
            name, expr = d.split("=")
            env[name] = eval(expr, {}, dict(env))
        q, ans = query.split("? ")
        assert env[q] == int(ans) and 0 <= env[q] <= 99
        first_ops, steps = sc.arithmetic(rng).split(": ")
        v = int(first_ops.split()[0])
        for op in first_ops.split()[1:]:
            v = eval(f"{v}{op}")
        assert steps.endswith(f"answer {v}")
        xs, ys = sc.sort_list(rng)[5:].split(" -> ")
        assert sorted(map(int, xs.split())) == list(map(int, ys.split()))
        w, r = sc.reverse_word(rng)[8:].split(" -> ")
        assert w[::-1] == r


def test_bundled_corpus_builds_once_and_is_trainable(tmp_path):
    path = bundled_corpus_path(tmp_path)
    assert path == tmp_path / sc.CORPUS_NAME
    meta = json.loads((path / "metadata.json").read_text())
    assert meta["tokenizer_info"] == {
        "vocab_size": 258,
        "name_or_path": "byte",
        "eos_token_id": 256,
    }
    assert meta["max_seq_len"] == 257 and meta["corpus"] == sc.CORPUS_NAME
    assert 3_000_000 <= meta["total_length"] <= 5_000_000
    assert 0.015 <= meta["holdout_tokens"] / meta["total_length"] <= 0.03
    pack = open_pack(path, seq_len=256, vocab_size=512, tokenizer_name="byte")
    assert len(pack.training_epochs) >= 2 and pack.holdout_epoch is not None
    mtime = (path / "tokens.npy").stat().st_mtime_ns
    assert (
        bundled_corpus_path(tmp_path) == path and (path / "tokens.npy").stat().st_mtime_ns == mtime
    )  # reused
    b = next(iter(build_train_loader(path, 256, 512, global_batch_rows=8, dp_rank=0, dp_world=1)))
    assert b["input_ids"].shape == (8, 256)


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_LOOM_CACHE", str(tmp_path / "cache"))
    from torchtitan_loom.components.data import default_cache_dir

    assert default_cache_dir() == tmp_path / "cache"


def _tiny_builder(calls):
    def build(final):
        calls.append(threading.get_ident())
        tmp = final.with_name(f".{final.name}.tmp-{threading.get_ident()}")
        tmp.mkdir()
        (tmp / "ok").write_text("done")
        try:
            tmp.rename(final)
        except OSError:
            (tmp / "ok").unlink()
            tmp.rmdir()
            raise FileExistsError(final) from None

    return build


def test_concurrent_first_use_all_get_the_winner(tmp_path):
    final = tmp_path / "corpus"
    calls, results, errors = [], [], []
    barrier = threading.Barrier(6)

    def worker():
        barrier.wait()
        try:
            results.append(
                ensure_built(final, _tiny_builder(calls), lambda p: (p / "ok").is_file())
            )
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [final] * 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]  # losers cleaned up


def test_broken_cache_entry_is_moved_aside_and_rebuilt(tmp_path):
    final = tmp_path / "corpus"
    final.mkdir()  # exists but does not verify (no 'ok' file)
    calls = []
    assert ensure_built(final, _tiny_builder(calls), lambda p: (p / "ok").is_file()) == final
    assert len(calls) == 1 and (final / "ok").is_file()
    assert len(list(tmp_path.glob(".corpus.broken-*"))) == 1
    with pytest.raises(ValueError, match="does not verify"):
        ensure_built(tmp_path / "never", lambda p: None, lambda p: False)


def test_concurrent_real_pack_builds_publish_one_complete_pack(tmp_path):
    """The real writer under a race: every caller gets the same valid pack, no temp dirs remain."""
    import functools

    final = tmp_path / "small"
    build = functools.partial(sc.write_bundled_pack, target_bytes=60_000)

    def verify(p):
        try:
            return open_pack(p, 256, 258).metadata["corpus"] == sc.CORPUS_NAME
        except (ValueError, OSError):
            return False

    results, errors = [], []
    barrier = threading.Barrier(4)

    def worker():
        barrier.wait()
        try:
            results.append(ensure_built(final, build, verify))
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [final] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]

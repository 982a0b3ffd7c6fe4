"""The checkpoint proof policy (components/checkpoint/proof.py) on its own, no manager, no files:
which checkpoint the steps after it prove, so that it may prune older ones."""

from torchtitan_loom.components.checkpoint.proof import PROOF_LOSS_RATIO, PROVE_STEPS, ProofPolicy


def _run(policy, steps):
    """steps: (step, healthy, loss or segment losses, saved after it)."""
    for step, healthy, loss, saved in steps:
        policy.note(step, healthy, loss if isinstance(loss, list) else [loss])
        if saved:
            policy.saved(step)
    return policy.proven


def test_two_healthy_steps_prove_a_checkpoint_and_not_one():
    assert PROVE_STEPS == 2
    policy = ProofPolicy()
    assert (
        _run(policy, [(1, True, 3.0, False), (2, True, 2.9, True), (3, True, 2.8, False)]) is None
    )
    assert _run(policy, [(4, True, 2.7, False)]) == 2
    assert policy.reference_loss == 2.7  # the proving step's loss is the next reference


def test_an_unhealthy_step_after_a_save_never_lets_it_prove():
    policy = ProofPolicy()
    _run(policy, [(1, True, 3.0, False), (2, True, 2.9, True), (3, False, 2.8, False)])
    assert _run(policy, [(4, True, 2.7, False), (5, True, 2.6, False)]) is None
    assert 2 not in policy.unproven


def test_an_explosion_inside_the_warm_up_proves_nothing():
    """The campaign's case: a finite explosion the spike guard's warm-up calls healthy. Its
    losses exceed PROOF_LOSS_RATIO × the launch's first loss, so the checkpoints saved during it
    prove nothing and the last good one stays the newest proven."""
    policy = ProofPolicy()
    good = [(s, True, 3.0 - 0.01 * s, s == 4) for s in range(1, 8)]
    assert _run(policy, good) == 4
    exploded = [(s, True, 3.0 * PROOF_LOSS_RATIO * (1 + s), True) for s in range(8, 14)]
    assert _run(policy, exploded) == 4  # every later checkpoint is kept, none proven


def test_a_dropped_save_proves_nothing_and_each_step_counts_once():
    policy = ProofPolicy()
    policy.note(1, True, [3.0])
    policy.saved(1)
    policy.dropped(1)
    assert _run(policy, [(2, True, 3.0, False), (3, True, 3.0, False)]) is None
    policy.saved(3)
    policy.note(4, True, [3.0])
    policy.note(4, True, [3.0])  # the same step again: not a second proving step
    assert policy.proven is None and policy.unproven == {3: 1}


def test_a_resumed_checkpoint_is_proven_by_the_steps_after_the_resume():
    policy = ProofPolicy()
    policy.resumed(8)
    policy.note(8, True, [2.0])  # at or before the resumed step: not counted
    assert _run(policy, [(9, True, 2.0, False), (10, True, 2.1, False)]) == 8


def test_the_reference_is_measured_before_the_launch_s_first_update():
    """Issue 43: a resume at lr 10 on three backprop segments. The first step's first segment is
    computed from the resumed weights (3.4); its later segments come after its own updates (362,
    285). Held against 3.4, no exploded step proves, so the resumed checkpoint stays the newest
    proven, whichever of the exploded losses a step reports last."""
    policy = ProofPolicy()
    policy.resumed(8)
    exploded = [[3.368, 362.0, 284.8]] + [[90.0 - s, 80.0, 61.0] for s in range(10, 40)]
    _run(policy, [(9 + i, True, losses, True) for i, losses in enumerate(exploded)])
    assert policy.reference_loss == 3.368 and policy.proven is None
    assert 8 not in policy.unproven  # step 9 exploded after it: step 8 proves nothing either


def test_a_later_segment_that_explodes_fails_the_proof():
    """Every segment loss of a proving step is held against the reference, not only its first."""
    policy = ProofPolicy()
    _run(policy, [(1, True, [3.0, 2.8, 2.7], True), (2, True, [2.9, 2.7, 2.6], False)])
    assert _run(policy, [(3, True, [2.9, 2.7, 2.6], False)]) == 1
    assert policy.reference_loss == 2.9  # the proving step's first segment
    _run(policy, [(4, True, [2.8, 2.6, 2.5], True), (5, True, [2.8, 2.6, 2.5], False)])
    assert _run(policy, [(6, True, [2.8, 2.9 * PROOF_LOSS_RATIO + 0.01, 9.0], False)]) == 1

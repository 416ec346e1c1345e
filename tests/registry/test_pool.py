"""The index pool: lowest free index, reuse, waiting in arrival order, restored assignments."""

from __future__ import annotations

import random

import pytest

from services.registry.pool import IndexPool, PoolError


def test_lowest_free_index_first_and_bidirectional_lookup() -> None:
    pool = IndexPool(3)
    assert [pool.acquire(r) for r in ("run_a", "run_b", "run_c")] == [0, 1, 2]
    assert pool.acquire("run_d") is None  # full
    assert pool.idx_of("run_b") == 1 and pool.run_id_of(1) == "run_b"
    assert pool.release("run_b") == 1
    assert pool.idx_of("run_b") is None and pool.run_id_of(1) is None
    assert pool.release("run_a") == 0
    assert pool.acquire("run_e") == 0  # the lowest free, not the last freed
    assert pool.acquire("run_f") == 1
    assert pool.assigned == {0: "run_e", 1: "run_f", 2: "run_c"}


def test_waiting_runs_get_freed_indices_oldest_first() -> None:
    pool = IndexPool(2)
    pool.acquire("run_a")
    pool.acquire("run_b")
    pool.enqueue("run_late", order=30)
    pool.enqueue("run_early", order=10)
    pool.enqueue("run_mid", order=20)
    pool.enqueue("run_early", order=99)  # re-enqueueing keeps the original place
    assert pool.waiting == ["run_early", "run_mid", "run_late"]
    assert pool.next_assignment() is None  # still full
    pool.release("run_b")
    assert pool.next_assignment() == ("run_early", 1)
    assert pool.next_assignment() is None
    pool.release("run_a")
    assert pool.dequeue("run_mid") and not pool.dequeue("run_mid")
    assert pool.next_assignment() == ("run_late", 0)
    assert pool.waiting == [] and pool.num_free == 0


def test_claim_restores_assignments_and_refuses_conflicts() -> None:
    pool = IndexPool(4)
    pool.claim("run_a", 2)
    pool.claim("run_a", 2)  # idempotent
    assert pool.acquire("run_b") == 0
    assert pool.acquire("run_c") == 1
    assert pool.acquire("run_d") == 3  # 2 was claimed
    with pytest.raises(PoolError, match="index 2 is held by run_a"):
        pool.claim("run_x", 2)
    with pytest.raises(PoolError, match=r"outside 0\.\.3"):
        pool.claim("run_y", 4)
    with pytest.raises(PoolError, match="already holds index"):
        pool.acquire("run_a")
    with pytest.raises(PoolError, match="cannot wait"):
        pool.enqueue("run_a", 0)


def test_an_index_is_never_held_twice_under_random_churn() -> None:
    rng = random.Random(7)
    pool = IndexPool(5)
    held: dict[str, int] = {}
    order = 0
    for step in range(2000):
        run_id = f"run_{rng.randrange(12)}"
        if run_id in held and rng.random() < 0.5:
            assert pool.release(run_id) == held.pop(run_id)
        elif run_id not in held and not pool.is_waiting(run_id):
            order += 1
            pool.enqueue(run_id, order)
        while (nxt := pool.next_assignment()) is not None:
            held[nxt[0]] = nxt[1]
        assert len(set(held.values())) == len(held), step
        assert pool.assigned == {i: r for r, i in held.items()}
        assert pool.num_free + len(held) == 5
        # nobody waits while an index is free
        assert not pool.waiting or pool.num_free == 0

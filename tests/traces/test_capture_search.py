"""The capture-list search (moebench.traces.capture_search) against brute force over every subset of candidates, on
small random traces; monotone in K; its refusals."""

from itertools import combinations

import numpy as np
import pytest

from moebench.traces.capture_search import (EngineShape, PricedTrace, SearchInputError, list_time, price_trace,
                                            search)


def _engine_calls(real: int, rows: int, engine: EngineShape) -> list[tuple[int, int]]:
    """One DP rank's layer calls (rows, real) in a step of `rows` DP-padded rows (engine_padding's arithmetic)."""
    halves = (rows // 2, rows - rows // 2) if engine.dbo else (rows,)
    calls, left = [], real
    for half in halves:
        m = min(left, half)
        left -= m
        chunk = -(-half // engine.sp_size)
        for s in range(engine.sp_size):
            if chunk:
                calls.append((chunk, min(max(m - s * chunk, 0), chunk)))
    return calls


def _pricer(seed: int, engine: EngineShape, monotone: bool):
    """A layer-like price (fixed cost, per row, per real row, a random bump per row count) of one DP rank's calls;
    with monotone=False the bump can make a larger padded size cheaper."""
    rng = np.random.default_rng(seed)
    bump = rng.uniform(0, 3.0 if monotone else 40.0, 4096)
    if monotone:
        bump = np.maximum.accumulate(bump)

    def call(rows: int, real: int) -> float:
        return 5.0 + 0.7 * rows + 1.3 * real + bump[rows]

    def price(real: int, rows: int) -> float:
        return sum(call(r, q) for r, q in _engine_calls(real, rows, engine))

    def eager(real: int, rows: int) -> float:
        return price(real, rows) + 9.0 * len(_engine_calls(real, rows, engine))
    return price, eager


def _trace(seed: int, dp: int, steps: int, top: int):
    rng = np.random.default_rng(seed)
    table = rng.integers(0, top + 1, size=(steps, dp))
    table[0, 0] = max(1, table[0, 0])
    return table, rng.integers(1, 6, size=steps)


def _brute(table, counts, priced: PricedTrace, k: int, price, eager, largest=None, keep=()):
    best = np.inf
    cands = priced.candidates.tolist()
    for m in range(0, k + 1):
        for sizes in combinations(cands, m):
            if largest is not None and (not sizes or sizes[-1] != largest):
                continue
            if not set(keep) <= set(sizes):
                continue
            best = min(best, list_time(table, counts, sizes, price, eager))
    return best


CASES = [  # (seed, dp, sp, dbo, steps, top tokens, monotone)
    (0, 1, 1, False, 12, 9, True), (1, 2, 1, False, 10, 11, True), (2, 2, 2, False, 14, 12, True),
    (3, 3, 1, True, 9, 10, True), (4, 2, 2, True, 11, 9, True), (5, 2, 1, False, 12, 10, False),
    (6, 1, 2, False, 12, 20, False)]


@pytest.mark.parametrize("seed,dp,sp,dbo,steps,top,monotone", CASES)
def test_search_equals_brute_force_over_every_subset(seed, dp, sp, dbo, steps, top, monotone):
    engine = EngineShape(dp, sp, dbo)
    table, counts = _trace(seed, dp, steps, top)
    price, eager = _pricer(seed, engine, monotone)
    priced = price_trace(table, counts, engine, price, eager)
    n = priced.candidates.size
    assert 3 <= n <= 11  # every subset: at most 2^11 lists
    assert priced.monotone == monotone  # the non-monotone cases go through the full minimum
    got = search(priced, list(range(1, n + 1)))
    for k in range(1, n + 1):
        choice = got.best[k]
        want = _brute(table, counts, priced, k, price, eager)
        assert choice.time_us == pytest.approx(want, rel=1e-12), k
        assert len(choice.sizes) <= k
        # the list returned costs what the search says, priced afresh step by step
        assert list_time(table, counts, choice.sizes, price, eager) == pytest.approx(choice.time_us, rel=1e-12)
    assert all(a >= b for a, b in zip(got.curve, got.curve[1:]))  # never worse with more graphs
    assert got.lower_bound_us == pytest.approx(list_time(table, counts, priced.candidates, price, eager), rel=1e-12)
    # every candidate captured is the optimum where the price grows with the padded size (elsewhere fewer sizes
    # can cost less: a bump makes a larger size cheaper)
    assert got.curve[n - 1] <= got.lower_bound_us * (1 + 1e-12)
    if priced.monotone:
        assert got.curve[n - 1] == pytest.approx(got.lower_bound_us, rel=1e-12)
    assert got.within_bound_k is not None and got.curve[got.within_bound_k - 1] <= got.lower_bound_us * 1.01
    assert got.within_bound_k == 1 or got.curve[got.within_bound_k - 2] > got.lower_bound_us * 1.01


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_fixed_largest_and_kept_sizes_equal_brute_force(seed):
    engine = EngineShape(2, 1, False)
    table, counts = _trace(seed, 2, 12, 12)
    price, eager = _pricer(seed, engine, True)
    priced = price_trace(table, counts, engine, price, eager)
    cands = priced.candidates.tolist()
    largest, keep = cands[-3], [cands[1]]
    got = search(priced, [2, 3, 4], largest=largest, keep=keep)
    for k, choice in got.best.items():
        assert choice.sizes[-1] == largest and set(keep) <= set(choice.sizes)
        assert choice.time_us == pytest.approx(_brute(table, counts, priced, k, price, eager, largest, keep),
                                               rel=1e-12)


def test_divide_and_conquer_equals_the_full_minimum_on_a_long_trace():
    engine = EngineShape(2, 1, False)
    table, counts = _trace(11, 2, 3000, 300)
    price, eager = _pricer(11, engine, True)
    priced = price_trace(table, counts, engine, price, eager)
    assert priced.monotone and priced.candidates.size > 250
    fast = search(priced, [1, 4, 16, 40])
    priced.monotone = False  # the same table through the O(K n^2) layers
    full = search(priced, [1, 4, 16, 40])
    assert fast.method == "divide and conquer" and full.method == "full minimum"
    for k in (1, 4, 16, 40):
        assert fast.best[k].time_us == pytest.approx(full.best[k].time_us, rel=1e-12)


def test_the_record_reruns_the_search():
    engine = EngineShape(2, 2, False)
    table, counts = _trace(3, 2, 20, 16)
    price, eager = _pricer(3, engine, True)
    priced = price_trace(table, counts, engine, price, eager)
    again = PricedTrace.from_record(priced.to_record())
    a, b = search(priced, [1, 2, 3]), search(again, [1, 2, 3])
    assert [a.best[k].sizes for k in (1, 2, 3)] == [b.best[k].sizes for k in (1, 2, 3)]
    assert all(c % 2 == 0 for c in priced.candidates.tolist())  # SP 2 without DBO: multiples of 2


def test_bad_input_is_refused_in_one_line():
    engine = EngineShape(1, 1, False)
    price, eager = _pricer(0, engine, True)
    priced = price_trace(np.array([[3], [5], [9]]), np.array([1, 1, 1]), engine, price, eager)
    for kwargs, why in [({"budgets": [0]}, "K=0 outside 1..3"), ({"budgets": [4]}, "K=4 outside 1..3"),
                        ({"budgets": [2], "largest": 6}, "fixed largest size 6 is not a candidate size"),
                        ({"budgets": [2], "keep": [4]}, "kept size 4 is not a candidate"),
                        ({"budgets": [1], "largest": 9, "keep": [3]}, "K=1 below the 2 sizes"),
                        ({"budgets": [2], "largest": 5, "keep": [9]}, "kept size 9 is above")]:
        with pytest.raises(SearchInputError, match=why) as e:
            search(priced, **kwargs)
        assert "\n" not in str(e.value)
    for table in (np.zeros((0, 1), np.int64), np.array([[0], [0]])):
        with pytest.raises(SearchInputError, match="no step with a real token"):
            price_trace(table, np.ones(len(table), np.int64), engine, price, eager)

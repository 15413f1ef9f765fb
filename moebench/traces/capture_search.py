"""The cheapest CUDA-graph capture list of at most K sizes for a trace: an exact partition dynamic program over the
candidate sizes (numpy only, no torch, no timing: the prices come in as functions).

A step's DP ranks pad to cudagraph_padded(max real over the DP ranks) (padding is monotone, so the largest rank
decides), and with a list of sizes the step pads to the smallest listed size >= that maximum, or runs eagerly,
unpadded, above the largest one. So a list cuts the steps, sorted by their maximum, into segments, each padded to
its top size, and the trace's time under a list is

    sum over listed sizes c of  sum over the steps that pad to c  of  price(step, c)
    + sum over the steps above the largest listed size              of  eager_price(step)

Candidates: the distinct step maxima; with sequence parallelism and no DBO each lifted to the next multiple of
sp_size (a size in between gives every step exactly the calls of that multiple: SP pads each call up to it, and the
real tokens fill the same chunks, so the multiple covers more steps at no cost). Over lists of candidates the result
is exact; over all lists too wherever the price does not fall as the padded size grows (a size between two
candidates can be moved down to the largest maximum under it), which `PricedTrace.monotone` records.

Group g = the steps whose (lifted) maximum is candidate g. The DP's input is the priced table
padded[g, j] = sum over group g's steps (times their counts) of price(step, candidates[j]), j >= g, and eager[g].
Segment (a..j] padded to j costs S(a, j) = sum_{g=a..j} padded[g, j]; F_k(j), the cheapest cover of the groups up
to j with k sizes the last of them j, is min_i F_{k-1}(i) + S(i + 1, j). Where the price is monotone in the padded
size, S is Monge (S(a,c) + S(b,d) <= S(a,d) + S(b,c) for a <= b <= c <= d: the difference is groups a..b-1 at c
against at d), so the leftmost minimising i is non-decreasing in j and each layer is solved by divide and
conquer, level by level in numpy: O(K n log n) time after the O(n^2) prefix table (n candidates), O(n^2) memory.
Where it is not monotone the same layers are solved by the full O(K n^2) minimum (`method` says which). Pricing
is separable by DP rank (a rank's calls depend only on its own real tokens and the padded size), so the table is
counts x rank prices: O(R n) price calls for R distinct real counts, and an [n, R] x [R, n] product.

Must-keep sizes and a fixed largest size split the candidates into blocks between them (each block's top is
forced); each block is solved for every size count and the blocks are combined by a min-plus knapsack over K.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

RankPrice = Callable[[int, int], float]  # (real tokens of one DP rank, padded rows of the step) -> us
WITHIN_BOUND = 0.01  # "the smallest K within 1% of the lower bound"


class SearchInputError(ValueError):
    """Input the search refuses (one line)."""


@dataclass(frozen=True)
class EngineShape:
    dp_size: int = 1
    sp_size: int = 1
    dbo: bool = False


def lifted(maxima: np.ndarray, engine: EngineShape) -> np.ndarray:
    """The candidate each step maximum pads to at best: itself, or with SP and no DBO the next multiple of
    sp_size (module docstring)."""
    if engine.sp_size > 1 and not engine.dbo:
        return -(-maxima // engine.sp_size) * engine.sp_size
    return maxima


@dataclass
class PricedTrace:
    """What the search prices, per side: the candidates, each group's steps and its time at every candidate it can
    pad to and eagerly. Enough to re-run the search without moebench (`to_record` / `from_record`)."""

    candidates: np.ndarray  # int64 [n], sorted
    weight: np.ndarray  # int64 [n]: steps in group g
    padded: np.ndarray  # float64 [n, n]: group g's steps at candidates[j] (j >= g; 0 below the diagonal)
    eager: np.ndarray  # float64 [n]: group g's steps run eagerly (above the largest listed size)
    monotone: bool = field(init=False)

    def __post_init__(self):
        # each group's price non-decreasing in the padded size (what the divide and conquer relies on); below
        # the diagonal the table is 0, so only the upper triangle's steps are compared
        upper = np.triu(self.padded)
        rises = np.diff(upper, axis=1)
        n = len(self.candidates)
        above = np.triu(np.ones((n, max(n - 1, 0)), bool))  # the step from j to j + 1 with j >= g
        slack = 1e-9 * max(1.0, float(np.abs(upper).max(initial=0.0)))
        self.monotone = not bool((rises[above] < -slack).any())

    def to_record(self) -> dict:
        n = len(self.candidates)
        return {"candidates": self.candidates.tolist(), "weight": self.weight.tolist(),
                "padded_us": [[round(float(v), 4) for v in self.padded[g, g:]] for g in range(n)],
                "eager_us": [round(float(v), 4) for v in self.eager]}

    @classmethod
    def from_record(cls, rec: Mapping) -> "PricedTrace":
        n = len(rec["candidates"])
        padded = np.zeros((n, n))
        for g, row in enumerate(rec["padded_us"]):
            padded[g, g:] = row
        return cls(np.asarray(rec["candidates"], np.int64), np.asarray(rec["weight"], np.int64), padded,
                   np.asarray(rec["eager_us"], np.float64))


def _aggregate(table: np.ndarray, counts: np.ndarray, padded_to: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                                    np.ndarray]:
    """(real, padded, weight): every (step, DP rank) pair's real count and its step's padded rows, merged where
    equal, weights summed."""
    reals = table.reshape(-1)
    rows = np.repeat(padded_to, table.shape[1])
    w = np.repeat(counts, table.shape[1])
    top = int(rows.max()) + 1 if rows.size else 1
    keys, inverse = np.unique(reals * top + rows, return_inverse=True)
    return keys // top, keys % top, np.bincount(inverse.reshape(-1), weights=w, minlength=keys.size)


def live_steps(steps, counts) -> tuple[np.ndarray, np.ndarray]:
    """The steps with a real token somewhere (the others cost nothing under any list); refused when none."""
    counts = np.asarray(counts, np.int64)
    steps = np.asarray(steps, np.int64).reshape(len(counts), -1) if len(counts) else np.zeros((0, 1), np.int64)
    if steps.shape[0] == 0 or not (steps.max(axis=1) > 0).any():
        raise SearchInputError("the trace has no step with a real token: nothing to search")
    live = steps.max(axis=1) > 0
    return steps[live], counts[live]


def candidate_sizes(steps, engine: EngineShape, keep: Sequence[int] = ()) -> np.ndarray:
    """The sizes the search chooses from: every (lifted) step maximum, and the kept sizes."""
    steps, _ = live_steps(steps, np.ones(len(steps), np.int64))
    return np.unique(np.concatenate([lifted(steps.max(axis=1), engine), np.asarray(list(keep), np.int64)]))


def price_trace(steps: np.ndarray, counts: np.ndarray, engine: EngineShape, price: RankPrice,
                eager_price: RankPrice, keep: Sequence[int] = ()) -> PricedTrace:
    """The PricedTrace of one side. `steps` int [S, dp_size]: the distinct steps' real tokens per DP rank;
    `counts` [S]; `price(real, rows)`: one DP rank's layer calls in a step padded to `rows` (cudagraph, then DP
    max); `eager_price(real, rows)`: the same run eagerly at its own maximum `rows`; `keep`: sizes added to the
    candidates (a must-keep size no step reaches). Steps with no real token anywhere cost nothing under any
    list and are left out."""
    steps, counts = live_steps(steps, counts)
    if steps.shape[1] != engine.dp_size:
        raise SearchInputError(f"steps have {steps.shape[1]} DP ranks' tokens for dp_size {engine.dp_size}")
    maxima = steps.max(axis=1)
    top = lifted(maxima, engine)
    candidates = candidate_sizes(steps, engine, keep)
    n = candidates.size
    group = np.searchsorted(candidates, top)
    weight = np.bincount(group, weights=counts, minlength=n).astype(np.int64)
    # padded[g, j] = sum over (step in g, rank) of count * price(real, c_j): N [n, R] @ F [R, n]
    reals_all = steps.reshape(-1)
    distinct_reals, real_index = np.unique(reals_all, return_inverse=True)
    rank_group = np.repeat(group, steps.shape[1])
    n_by = np.zeros((n, distinct_reals.size))
    np.add.at(n_by, (rank_group, real_index.reshape(-1)), np.repeat(counts, steps.shape[1]).astype(np.float64))
    lowest = np.full(distinct_reals.size, n, np.int64)  # the first group holding each real count
    np.minimum.at(lowest, real_index.reshape(-1), rank_group)
    f = np.zeros((distinct_reals.size, n))
    for r_i, r in enumerate(distinct_reals.tolist()):
        for j in range(int(lowest[r_i]), n):
            f[r_i, j] = price(int(r), int(candidates[j]))
    padded = np.triu(n_by @ f)
    # eager: each step at its own (unlifted) maximum
    e_real, e_rows, e_w = _aggregate(steps, counts, maxima)
    e_cost = np.array([eager_price(int(r), int(m)) for r, m in zip(e_real.tolist(), e_rows.tolist())])
    eager = np.zeros(n)
    np.add.at(eager, np.searchsorted(candidates, lifted(e_rows, engine)), e_w * e_cost)
    return PricedTrace(candidates, weight, padded, eager)


def list_time(steps: np.ndarray, counts: np.ndarray, sizes: Sequence[int], price: RankPrice,
              eager_price: RankPrice) -> float:
    """The trace's time under any list of sizes (not only candidates), priced as the search prices."""
    steps, counts = live_steps(steps, counts)
    maxima = steps.max(axis=1)
    sizes_arr = np.asarray(sorted(sizes), np.int64)
    at = np.searchsorted(sizes_arr, maxima)
    eager_step = at >= sizes_arr.size
    padded_to = maxima.copy()
    padded_to[~eager_step] = sizes_arr[at[~eager_step]]
    total = 0.0
    for which, fn in ((~eager_step, price), (eager_step, eager_price)):
        if which.any():
            r, rows, w = _aggregate(steps[which], counts[which], padded_to[which])
            total += float(sum(wi * fn(int(ri), int(pi)) for ri, pi, wi in zip(r.tolist(), rows.tolist(), w)))
    return total


# -- the partition DP --------------------------------------------------------------------------------------------

def _prefix(padded: np.ndarray) -> np.ndarray:
    """C[i, j] = sum_{g < i} padded[g, j]: S(a, j) = C[j + 1, j] - C[a, j]."""
    n = padded.shape[0]
    c = np.zeros((n + 1, n))
    np.cumsum(padded, axis=0, out=c[1:])
    return c


def _layer_full(prev: np.ndarray, c: np.ndarray, lo: int, hi: int, first: int) -> tuple[np.ndarray, np.ndarray]:
    """F_k(j) for j in [first, hi] from F_{k-1} = prev (inf where undefined): the full minimum over i in
    [first - 1, j - 1]. Returns (values over lo..hi, argmin i)."""
    width = hi - lo + 1
    out = np.full(width, np.inf)
    arg = np.full(width, -1, np.int64)
    for j in range(first, hi + 1):
        i = np.arange(first - 1, j)
        v = prev[i - lo] + c[j + 1, j] - c[i + 1, j]
        b = int(np.argmin(v))
        out[j - lo], arg[j - lo] = v[b], i[b]
    return out, arg


def _layer_dc(prev: np.ndarray, c: np.ndarray, lo: int, hi: int, first: int) -> tuple[np.ndarray, np.ndarray]:
    """As _layer_full, by divide and conquer on the monotone leftmost argmin, one numpy pass per level."""
    width = hi - lo + 1
    out = np.full(width, np.inf)
    arg = np.full(width, -1, np.int64)
    # intervals of j [jl, jr] whose argmin lies in [il, ir]
    jl = np.array([first]); jr = np.array([hi]); il = np.array([first - 1]); ir = np.array([hi - 1])
    while jl.size:
        mid = (jl + jr) // 2
        top = np.minimum(ir, mid - 1)
        lens = top - il + 1
        seg = np.repeat(np.arange(mid.size), lens)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        i = il[seg] + (np.arange(seg.size) - starts[seg])
        j = mid[seg]
        v = prev[i - lo] + c[j + 1, j] - c[i + 1, j]
        best = np.minimum.reduceat(v, starts)
        # leftmost position of each segment's minimum
        hit = np.flatnonzero(v == best[seg])
        first_hit = hit[np.searchsorted(seg[hit], np.arange(mid.size))]
        opt = i[first_hit]
        out[mid - lo], arg[mid - lo] = best, opt
        left = mid > jl
        right = mid < jr
        jl, jr, il, ir = (np.concatenate([jl[left], mid[right] + 1]), np.concatenate([mid[left] - 1, jr[right]]),
                          np.concatenate([il[left], opt[right]]), np.concatenate([opt[left], ir[right]]))
    return out, arg


def _block(c: np.ndarray, lo: int, hi: int, kmax: int, monotone: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per k = 1..kmax: F_k over j in lo..hi (groups lo..j covered by k sizes, the last at j) and its argmins."""
    values, args = [], []
    j = np.arange(lo, hi + 1)
    f1 = c[j + 1, j] - c[lo, j]
    values.append(f1)
    args.append(np.full(hi - lo + 1, lo - 1, np.int64))
    layer = _layer_dc if monotone else _layer_full
    for k in range(2, kmax + 1):
        first = lo + k - 1
        if first > hi:
            break
        got, arg = layer(values[-1], c, lo, hi, first)
        values.append(got)
        args.append(arg)
    return values, args


def _trace_back(args: list[np.ndarray], lo: int, k: int, j: int) -> list[int]:
    out = []
    while k >= 1:
        out.append(j)
        j = int(args[k - 1][j - lo])
        k -= 1
    return out[::-1]


@dataclass(frozen=True)
class Choice:
    sizes: tuple[int, ...]  # the list (at most K sizes)
    time_us: float  # the trace's priced time under it


@dataclass(frozen=True)
class SearchResult:
    best: dict[int, Choice]  # per budget K asked for
    curve: list[float]  # the optimum at K = 1, 2, ... (the Pareto curve), as far as it was computed
    lower_bound_us: float  # every candidate captured
    within_bound_k: int | None  # smallest K within WITHIN_BOUND of it (None: not within the curve computed)
    candidates: int
    method: str  # "divide and conquer" (monotone prices) or "full minimum"
    curve_lists: list[tuple[int, ...]] = field(default_factory=list)  # the list at each K of the curve


def _curves(priced: PricedTrace, c: np.ndarray, forced: list[int], fixed_top: bool, kcap: int
            ) -> list[list[tuple[float, list[int]]]]:
    """Per block between forced sizes: (cost, candidate indices) by the count of sizes it uses (0..)."""
    n = int(priced.candidates.size)
    eager_after = np.concatenate([np.cumsum(priced.eager[::-1])[::-1], [0.0]])  # eager_after[t]: groups >= t
    curves, lo = [], 0
    for f in forced:  # a block whose top is forced: groups lo..f, f listed
        vals, args = _block(c, lo, f, min(kcap, f - lo + 1), priced.monotone)
        curves.append([(np.inf, [])] + [(float(v[-1]), _trace_back(args, lo, k + 1, f)) for k, v in enumerate(vals)])
        lo = f + 1
    if lo > n - 1:
        return curves
    if fixed_top:  # the groups above the fixed largest size run eagerly
        curves.append([(float(eager_after[lo]), [])])
        return curves
    vals, args = _block(c, lo, n - 1, min(kcap, n - lo), priced.monotone)  # free top, eager above it
    curve = [(float(eager_after[lo]), [])]
    for k, v in enumerate(vals):
        total = v + eager_after[np.arange(lo, n) + 1]
        j = int(np.argmin(total))
        curve.append((float(total[j]), _trace_back(args, lo, k + 1, lo + j)))
    curves.append(curve)
    return curves


def _at_most(curves: list[list[tuple[float, list[int]]]], kcap: int) -> list[tuple[float, list[int]]]:
    """Min-plus knapsack over the blocks: the cheapest choice with at most k sizes, k = 1..kcap."""
    exact: list[tuple[float, list[int]]] = [(0.0, [])]
    for curve in curves:
        nxt: list[tuple[float, list[int]]] = [(np.inf, [])] * min(kcap + 1, len(exact) + len(curve) - 1)
        for a, (ca, la) in enumerate(exact):
            for b, (cb, lb) in enumerate(curve):
                if a + b < len(nxt) and ca + cb < nxt[a + b][0]:
                    nxt[a + b] = (ca + cb, la + lb)
        exact = nxt
    out, best = [], exact[0]  # no size at all (every step eager) is a list too
    for k in range(1, kcap + 1):
        if k < len(exact) and exact[k][0] < best[0]:
            best = exact[k]
        out.append(best)
    return out


def search_input_problem(candidates: np.ndarray, budgets: Sequence[int], largest: int | None = None,
                         keep: Sequence[int] = ()) -> str | None:
    """Why the search refuses these budgets, fixed largest size and kept sizes for these candidates, or None."""
    cand = np.asarray(candidates, np.int64)
    n = int(cand.size)
    if not budgets:
        return "no graph budget K given"
    for k in budgets:
        if not 1 <= int(k) <= n:
            return f"graph budget K={k} outside 1..{n} (the trace's candidate sizes)"
    known = set(cand.tolist())
    for name, values in (("fixed largest size", [] if largest is None else [largest]), ("kept size", keep)):
        for v in values:
            if int(v) not in known:
                near = cand[np.argsort(np.abs(cand - int(v)), kind="stable")[:3]]
                return (f"{name} {v} is not a candidate size (a size some step pads to; nearest: "
                        f"{', '.join(map(str, sorted(near.tolist())))})")
    above = [int(v) for v in keep if largest is not None and int(v) > int(largest)]
    if above:
        return f"kept size {above[0]} is above the fixed largest size {largest}"
    must = len(set(int(v) for v in keep) | ({int(largest)} if largest is not None else set()))
    if must and min(int(k) for k in budgets) < must:
        return f"graph budget K={min(int(k) for k in budgets)} below the {must} sizes that must stay"
    return None


def search(priced: PricedTrace, budgets: Sequence[int], largest: int | None = None,
           keep: Sequence[int] = ()) -> SearchResult:
    """The cheapest list of at most K sizes for each K in `budgets` (each 1 <= K <= candidates), with `largest` (a
    candidate) as the list's largest size when given, and every size of `keep` (candidates) in it. The curve is
    computed up to the largest K asked for, and on (doubling) until it comes within WITHIN_BOUND of the lower
    bound, every candidate captured."""
    cand = priced.candidates
    n = int(cand.size)
    index = {int(v): i for i, v in enumerate(cand.tolist())}
    why = search_input_problem(cand, budgets, largest, keep)
    if why:
        raise SearchInputError(why)
    forced = sorted({index[int(v)] for v in keep} | ({index[int(largest)]} if largest is not None else set()))
    c = _prefix(priced.padded)
    top = index[int(largest)] if largest is not None else n - 1
    lower = float(np.trace(priced.padded[:top + 1, :top + 1]) + priced.eager[top + 1:].sum())
    kcap = max(int(k) for k in budgets)
    while True:
        at_most = _at_most(_curves(priced, c, forced, largest is not None, kcap), kcap)
        within = next((k + 1 for k, (v, _) in enumerate(at_most) if v <= lower * (1 + WITHIN_BOUND)), None)
        if within is not None or kcap >= n:
            break
        kcap = min(n, 2 * kcap)
    best = {int(k): Choice(tuple(int(cand[i]) for i in at_most[int(k) - 1][1]), float(at_most[int(k) - 1][0]))
            for k in budgets}
    return SearchResult(best, [float(v) for v, _ in at_most], lower, within, n,
                        "divide and conquer" if priced.monotone else "full minimum",
                        [tuple(int(cand[i]) for i in sizes) for _, sizes in at_most])

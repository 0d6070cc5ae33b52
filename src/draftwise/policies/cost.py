"""The cost model: predicted seconds of one target forward and one drafter step.

Fitted from a measured hardware profile (profile.py) by least squares; the goodput policy asks it
what a step would cost for a candidate choice of verification lengths:

    target_seconds(B, T, C) = t0 + t_seq * B + t_tok * T + t_ctx * B * C
    draft_seconds(B, C)     = d0 + d_seq * B + d_ctx * B * C         (one drafter step)

B = sequences in the forward, T = tokens fed in all (sum over sequences of 1 + verified
proposals), C = mean context length (keys each new token attends). A coefficient that the fit
makes negative is clamped to 0 (more work never predicts less time).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CostModel:
    target: tuple[float, float, float, float]  # (t0, t_seq, t_tok, t_ctx) seconds
    draft: tuple[float, float, float]  # (d0, d_seq, d_ctx) seconds, one drafter step

    def target_seconds(self, num_seqs: int, num_tokens: int, context: float = 0.0) -> float:
        t0, t_seq, t_tok, t_ctx = self.target
        return t0 + t_seq * num_seqs + t_tok * num_tokens + t_ctx * num_seqs * context

    def draft_seconds(self, num_seqs: int, context: float = 0.0) -> float:
        if num_seqs <= 0:
            return 0.0
        d0, d_seq, d_ctx = self.draft
        return d0 + d_seq * num_seqs + d_ctx * num_seqs * context

    def to_dict(self) -> dict:
        return {"target": list(self.target), "draft": list(self.draft)}

    @staticmethod
    def from_dict(d: dict) -> "CostModel":
        t, dr = d["target"], d["draft"]
        if len(t) != 4 or len(dr) != 3:
            raise ValueError(f"cost model: expected 4 target and 3 draft coefficients, got {len(t)} and {len(dr)}")
        return CostModel(tuple(float(x) for x in t), tuple(float(x) for x in dr))


class OnlineCost:
    """The profile's cost model plus what it misses, learned online from the engine's step times.

    A whole engine step also pays for work outside the two forwards (scheduling, processing the
    logits, verification, postprocess: Python work that grows with the rows B and the tokens T),
    a drafter step costs what the profile's isolated timing does not say, and the machine's speed
    drifts. The residual r = measured step - profile's prediction of every decode step is fitted as
    e0 + e1 * B + e2 * T + e3 * D (D = drafter steps) by exponentially weighted least squares on
    centred features, slopes constrained to be >= 0: the slopes come only from how B, T and D
    varied among the steps seen (a slope the data cannot tell is 0, so a run that never drafted
    does not learn that a verified token costs the whole residual), and the intercept takes the
    mean. `step_seconds` is the profile's prediction plus that residual; the goodput policy
    optimises against it.

    `row_block` > 0 (the rows one pass over the weights serves: 16 on AMX tiles, model/act8.py's
    `row_block`) adds a fourth term, e4 * (ceil(T / row_block) - 1): the passes past the first,
    which a line in T cannot show (on the Qwen 1.5B, 16 rows on tiles cost 1.75x one row and 17
    rows 2.14x). It stays 0 until steps past a block are measured.
    """

    DECAY = 0.98  # per observed step: the fit follows the last ~50 steps
    RIDGE = 1e-3  # in units of B^2, T^2, D^2 (passes^2) per unit of weight: slopes need real variation
    REFIT_EVERY = 4  # steps (after the first 8): the solve costs more than the rest of the update

    def __init__(self, cost: CostModel, row_block: int = 0):
        self.cost = cost
        self.row_block = row_block
        self._fit = DecayedFit(4 if row_block else 3, self.DECAY, self.RIDGE)  # r against (B, T, D[, passes])
        # e0, e1 (per row), e2 (per token), e3 (per drafter step), e4 (per pass past the first)
        self._coef = (0.0, 0.0, 0.0, 0.0, 0.0)

    def _passes(self, num_tokens: int) -> int:
        """Passes over the weights past the first for T tokens fed (0 without a row block)."""
        return (max(1, num_tokens) - 1) // self.row_block if self.row_block else 0

    @staticmethod
    def draft_lengths_seconds(cost: CostModel, lengths, context: float) -> float:
        """Drafter time for rows drafting `lengths` tokens: step j runs the rows drafting past j."""
        return _by_steps(lambda rows: cost.draft_seconds(rows, context), lengths)

    def drafting_seconds(self, lengths, context: float) -> float:
        """`draft_lengths_seconds` with each drafter step's learned residual (`draft_step_seconds`)."""
        return _by_steps(lambda rows: self.draft_step_seconds(rows, context), lengths)

    def residual(self, num_seqs: int, num_tokens: int, drafter_steps: int = 0) -> float:
        e0, e1, e2, e3, e4 = self._coef
        return e0 + e1 * num_seqs + e2 * num_tokens + e3 * drafter_steps + e4 * self._passes(num_tokens)

    def draft_step_seconds(self, num_seqs: int, context: float) -> float:
        """One drafter step over num_seqs rows: the profile's, plus the learned per-step residual."""
        if num_seqs <= 0:
            return 0.0
        return max(0.0, self.cost.draft_seconds(num_seqs, context) + self._coef[3])

    def profile_seconds(self, num_seqs: int, num_tokens: int, context: float, draft_lengths=()) -> float:
        return (self.draft_lengths_seconds(self.cost, draft_lengths, context)
                + self.cost.target_seconds(num_seqs, num_tokens, context))

    def context_slope(self, num_seqs: int, draft_lengths=()) -> float:
        """Seconds of profile_seconds per token of mean context: the target's t_ctx * B and the
        drafter's d_ctx per row-step (the rest does not change as the rows' contexts grow)."""
        return self.cost.target[3] * num_seqs + self.cost.draft[2] * sum(draft_lengths)

    def step_seconds(self, num_seqs: int, num_tokens: int, context: float, draft_lengths=()) -> float:
        steps = max(list(draft_lengths), default=0)
        return (self.profile_seconds(num_seqs, num_tokens, context, draft_lengths)
                + self.residual(num_seqs, num_tokens, steps))

    def tokens_seconds(self, num_seqs: int, context: float):
        """step_seconds(num_seqs, T, context) without drafting, as a function of T (what
        `choose_lengths` asks for every candidate: the same value, fewer calls)."""
        e0, e1, e2, _, e4 = self._coef
        const = e0 + e1 * num_seqs
        target, passes = self.cost.target_seconds, self._passes
        if e4:
            return lambda t: target(num_seqs, t, context) + const + e2 * t + e4 * passes(t)
        return lambda t: target(num_seqs, t, context) + const + e2 * t

    def observe(self, num_seqs: int, num_tokens: int, context: float, draft_lengths, measured: float,
                profile: float | None = None, steps: int = 1) -> None:
        """One measured decode step (profile: profile_seconds(...) when already known). The earlier
        observations fade by DECAY ** `steps`: 1 for this step, more where steps ran unobserved
        since the last one (plain steps a multi-step call ran), so that what was measured before
        such a stretch does not stand for good."""
        lengths = list(draft_lengths)
        if profile is None:
            profile = self.profile_seconds(num_seqs, num_tokens, context, lengths)
        fit = self._fit
        x = (float(num_seqs), float(num_tokens), float(max(lengths, default=0)))
        fit.observe(x + (float(self._passes(num_tokens)),) if self.row_block else x, measured - profile, steps)
        if fit.seen > 8 and fit.seen % self.REFIT_EVERY:  # the fit moves slowly: refitted every few steps
            return
        e0, slopes = fit.solve()
        self._coef = (e0, *slopes, 0.0)[:5]  # (without a row block e4 stays 0)


class DecayedFit:
    """y ~ c0 + slopes . x by exponentially weighted least squares on centred features (`decay` per
    observation, `ridge` added to each feature's variance), slopes constrained to be >= 0: a slope
    the data cannot tell (a feature that did not vary) is 0 and the intercept takes the mean. The
    decayed sums in plain floats (an observation's update; numpy's per-call cost was most of it)."""

    def __init__(self, n: int, decay: float, ridge: float):
        self.n, self.decay, self.ridge = n, decay, ridge
        self.w = self.sy = 0.0  # decayed weight, sum of y
        self.sx, self.sxy = [0.0] * n, [0.0] * n
        self.sxx = [[0.0] * n for _ in range(n)]
        self.seen = 0  # observations

    def observe(self, x, y: float, steps: int = 1) -> None:
        """One observation; the earlier ones fade by decay ** steps."""
        d, n = self.decay ** max(1, steps), self.n
        self.w = self.w * d + 1.0
        self.sy = self.sy * d + y
        sx, sxy, sxx = self.sx, self.sxy, self.sxx
        for i in range(n):
            sx[i] = sx[i] * d + x[i]
            sxy[i] = sxy[i] * d + x[i] * y
            row = sxx[i]
            for j in range(n):
                row[j] = row[j] * d + x[i] * x[j]
        self.seen += 1

    def solve(self) -> tuple[float, list[float]]:
        """(intercept, slopes) of the observations so far (0 and zeros before any)."""
        if not self.seen:
            return 0.0, [0.0] * self.n
        w, n, sxx = self.w, self.n, self.sxx
        mx, my = [v / w for v in self.sx], self.sy / w
        cxx = [[sxx[i][j] / w - mx[i] * mx[j] + (self.ridge if i == j else 0.0) for j in range(n)] for i in range(n)]
        cxy = [self.sxy[i] / w - mx[i] * my for i in range(n)]
        slopes = _nonnegative_solve(cxx, cxy)
        return my - sum(a * b for a, b in zip(slopes, mx)), slopes


def _nonnegative_solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b with x >= 0 (active set): more rows, tokens or drafter steps never cost less.
    Unconstrained, collinear features (at batch 1, tokens = 1 + drafter steps) split the
    residual into a large negative and a large positive slope, e.g. verification looking
    cheaper than free and each drafter step three times its cost. (Plain floats: numpy's
    per-call cost made a 3 x 3 solve ~0.4 ms.)"""
    n = len(b)
    free = [True] * n
    while True:
        idx = [i for i in range(n) if free[i]]
        x = [0.0] * n
        if not idx:
            return x
        sol = _solve([[a[i][j] for j in idx] for i in idx], [b[i] for i in idx])
        for i, v in zip(idx, sol):
            x[i] = v
        if all(v >= 0 for v in sol):
            return x
        free = [f and x[i] >= 0 for i, f in enumerate(free)]  # drop the negative slopes, solve the rest


def _by_steps(step_seconds, lengths) -> float:
    """Seconds of drafting `lengths` tokens per row: drafter step j over the rows drafting past j."""
    lengths = list(lengths)
    return sum(step_seconds(sum(n > j for n in lengths)) for j in range(max(lengths, default=0)))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """A small dense system by Gaussian elimination with partial pivoting (a is symmetric positive
    definite here: a covariance plus a ridge)."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        piv = m[c][c]
        if piv == 0.0:
            raise ZeroDivisionError("singular system")
        for r in range(c + 1, n):
            f = m[r][c] / piv
            if f:
                for j in range(c, n + 1):
                    m[r][j] -= f * m[c][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][j] * x[j] for j in range(r + 1, n))) / m[r][r]
    return x


class GridCost(CostModel):
    """The target's cost read off the measured grid itself, the drafter's from the fit.

    A straight line in tokens cannot be right at both ends: at one sequence, verifying four more
    tokens costs almost nothing (the step reads the weights once either way), at 64 sequences
    every token costs. So the target's time at (B sequences, T tokens) is interpolated in the
    measured points of the profile's first context: linearly in tokens per sequence within each
    measured B, then linearly in B between the two measured batch sizes around it (extrapolated
    along the last segment outside the grid); the context term is the fit's t_ctx * B * (C - C0).

    Each B's seconds are made non-decreasing in tokens first (`monotone`): more work never
    predicts less time. Measured points carry noise and cache effects (a profile timed right
    after other shapes put 4 rows at 2.35 ms and 1 row at 2.88 on an Intel Xeon), and a curve
    with a dip stops DSpark's early-stopped admission at the dip's start, before the rows that
    cost nothing more.
    """

    def __init__(self, fit: CostModel, points: list[tuple[int, int, int, float]]):
        super().__init__(fit.target, fit.draft)
        if not points:
            raise ValueError("GridCost needs measured points")
        self.context0 = min(c for _, _, c, _ in points)
        table: dict[int, dict[int, float]] = {}
        for b, t, c, s in points:
            if c == self.context0:
                table.setdefault(b, {})[t] = s
        self._bs = sorted(table)
        self._rows = {b: monotone(sorted(table[b].items())) for b in self._bs}
        self._base: dict[tuple[int, int], float] = {}  # (B, T) -> interpolated seconds at context0

    @staticmethod
    def _lerp(xs: list[tuple[float, float]], x: float) -> float:
        if len(xs) == 1:
            return xs[0][1]
        i = 1
        while i < len(xs) - 1 and xs[i][0] < x:
            i += 1
        (x0, y0), (x1, y1) = xs[i - 1], xs[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def target_seconds(self, num_seqs: int, num_tokens: int, context: float = 0.0) -> float:
        b = max(1, num_seqs)
        base = self._base.get((b, num_tokens))
        if base is None:  # the policy asks the same few (B, T) every step
            per_seq = num_tokens / b
            by_b = [(bb, self._lerp(self._rows[bb], per_seq)) for bb in self._bs]
            base = self._base[(b, num_tokens)] = max(0.0, self._lerp(by_b, b))
        return base + self.target[3] * b * (context - self.context0)


def monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(x, y) points sorted by x -> the same x with y non-decreasing: the least-squares fit
    (pool adjacent violators: a run that falls is replaced by its mean)."""
    blocks: list[list[float]] = []  # [sum of y, count]
    for _, y in points:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            y2, n2 = blocks.pop()
            blocks[-1][0] += y2
            blocks[-1][1] += n2
    ys = [total / n for total, n in blocks for _ in range(int(n))]
    return [(x, y) for (x, _), y in zip(points, ys)]


class BlockCost:
    """Seconds of one drafting round of a drafter on the target's features (DSpark's block forward,
    EAGLE-3's steps), which a profile does not time: a + b * rows (`DecayedFit`, b >= 0; one batch
    size seen: its mean) of the engine's measured drafting seconds. 0 before anything is
    measured, so the first steps draft and measure it."""

    DECAY = 0.98  # per observed step: the fit follows the last ~50 drafting steps
    RIDGE = 1e-9  # rows^2: a batch size that never varied gives no slope

    def __init__(self):
        self._fit = DecayedFit(1, self.DECAY, self.RIDGE)

    @property
    def seen(self) -> int:
        return self._fit.seen

    def observe(self, rows: int, seconds: float) -> None:
        self._fit.observe((float(rows),), seconds)

    def seconds(self, rows: int) -> float:
        if rows <= 0 or not self.seen:
            return 0.0
        a, (b,) = self._fit.solve()
        return max(0.0, a + b * rows)

"""Statistical tests of the sampling pipeline (temperature -> top-k/top-p/min-p -> draw).

Fixed logits, 10k draws per setting, all settings in ONE batch (one kernel call per op, rows
with different settings side by side). Frequencies must pass a chi-square goodness-of-fit test
against the exact filtered distribution (computed here independently, in float64 numpy);
filtered-out tokens must never appear. The p-value comes from torch.special.gammaincc (the
chi-square survival function), so no scipy is needed. All seeds are fixed: deterministic.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET must be set before
triton is first imported, hence the setdefault at the top).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

import kernels

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N = 10_000  # draws per setting
P_MIN = 1e-3  # chi-square p-value threshold (deterministic seeds: a pass is stable)

LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 0.8, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0, 0.9, 1.9, -0.2, 0.1])
V = len(LOGITS)

# name: (temperature, top_k, top_p, min_p)
SETTINGS = {
    "plain": (1.0, -1, 1.0, 0.0),
    "temperature_0.6": (0.6, 0, 1.0, 0.0),
    "temperature_1.7": (1.7, -1, 1.0, 0.0),
    "top_k_4": (1.0, 4, 1.0, 0.0),
    "top_p_0.75": (1.0, -1, 0.75, 0.0),
    "min_p_0.2": (1.0, -1, 1.0, 0.2),
    "combined": (0.8, 6, 0.9, 0.05),
    "top_p_min_p_hot": (1.4, 10, 0.6, 0.1),
    "greedy": (0.0, 3, 0.5, 0.0),
}
STREAM = "combined"  # also drawn as ONE seed over N consecutive steps (offsets 0..N-1)


def _triton_unavailable() -> str | None:
    try:
        from kernels import triton_ops
    except Exception as exc:  # pragma: no cover
        return f"triton unavailable: {exc!r}"
    if triton_ops.interpreted() != (DEVICE.type == "cpu"):
        return "triton was imported before TRITON_INTERPRET=1 was set; run the kernel tests on their own"
    return None


_SKIP = _triton_unavailable()


def exact_distribution(temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Filtered, renormalised distribution from the definitions (distinct logits, no ties)."""
    z = LOGITS / temperature if temperature > 0 else LOGITS.copy()
    if temperature <= 0:
        out = np.zeros(V)
        out[np.argmax(z)] = 1.0
        return out
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-z)
    keep = np.ones(V, dtype=bool)
    if 0 < top_k < V:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        excl = np.cumsum(p[order]) - p[order]  # mass strictly above each token
        assert np.abs(excl - top_p).min() > 1e-3, "setting too close to a top-p boundary"
        keep[order[excl >= top_p]] = False
    if min_p > 0:
        assert np.abs(p / p.max() - min_p).min() > 1e-3, "setting too close to a min-p boundary"
        keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit over the support of probs; bins with expected count < 5 are merged."""
    n = counts.sum()
    support = probs > 0
    exp, obs = probs[support] * n, counts[support].astype(np.float64)
    small = exp < 5
    if small.any():
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    if len(exp) < 2:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _batch():
    names, rows = [], []
    for i, (name, (t, k, p, mp)) in enumerate(SETTINGS.items()):
        names += [name] * N
        seeds = 1_000_003 * (i + 1) + np.arange(N)  # a different seed per row, step 0
        rows += [(t, k, p, mp, int(s), 0) for s in seeds]
    t, k, p, mp = SETTINGS[STREAM]
    names += ["stream"] * N
    rows += [(t, k, p, mp, 987654321, step) for step in range(N)]  # one request, N steps
    cols = list(zip(*rows))
    B = len(rows)
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(B, V).contiguous().to(DEVICE)
    params = dict(
        temperature=torch.tensor(cols[0], dtype=torch.float32, device=DEVICE),
        top_k=torch.tensor(cols[1], dtype=torch.int32, device=DEVICE),
        top_p=torch.tensor(cols[2], dtype=torch.float32, device=DEVICE),
        min_p=torch.tensor(cols[3], dtype=torch.float32, device=DEVICE),
        seeds=torch.tensor(cols[4], dtype=torch.int64, device=DEVICE),
        offsets=torch.tensor(cols[5], dtype=torch.int64, device=DEVICE),
    )
    return np.array(names), logits, params


def _draw(logits, prm, use_triton: bool) -> np.ndarray:
    greedy = prm["temperature"] <= 0
    x = kernels.apply_temperature(logits, prm["temperature"], use_triton=use_triton)
    x = kernels.top_k_top_p_min_p(x, prm["top_k"], prm["top_p"], prm["min_p"], use_triton=use_triton)
    tok = kernels.sample(x, prm["seeds"], prm["offsets"], greedy, use_triton=use_triton)
    return tok.cpu().numpy()


@pytest.fixture(scope="module")
def draws():
    if _SKIP:
        pytest.skip(_SKIP)
    names, logits, prm = _batch()
    return names, _draw(logits, prm, use_triton=True), prm


@pytest.fixture(scope="module")
def reference_draws():
    names, logits, prm = _batch()
    return names, _draw(logits, prm, use_triton=False)


def _setting(name):
    return SETTINGS[STREAM if name == "stream" else name]


@pytest.mark.parametrize("name", list(SETTINGS) + ["stream"])
def test_kernel_frequencies_match_exact_distribution(draws, name):
    names, tok, _ = draws
    probs = exact_distribution(*_setting(name))
    counts = np.bincount(tok[names == name], minlength=V)
    assert counts.sum() == N
    assert counts[probs == 0].sum() == 0, f"filtered-out tokens drawn: {counts[probs == 0]}"
    pval = chi_square_pvalue(counts, probs)
    assert pval > P_MIN, f"{name}: chi-square p={pval:.2e}, counts={counts.tolist()}, expected={(probs * N).round(1).tolist()}"


@pytest.mark.parametrize("name", list(SETTINGS) + ["stream"])
def test_reference_frequencies_match_exact_distribution(reference_draws, name):
    names, tok = reference_draws
    probs = exact_distribution(*_setting(name))
    counts = np.bincount(tok[names == name], minlength=V)
    assert counts[probs == 0].sum() == 0
    assert chi_square_pvalue(counts, probs) > P_MIN


def test_chi_square_has_power(draws):
    """The same draws are rejected against a wrong distribution (the test can fail)."""
    names, tok, _ = draws
    wrong = {
        "temperature_0.6": exact_distribution(1.0, -1, 1.0, 0.0),
        "top_p_0.75": exact_distribution(1.0, -1, 0.9, 0.0),
        "combined": exact_distribution(1.0, 6, 1.0, 0.0),
    }
    for name, probs in wrong.items():
        counts = np.bincount(tok[names == name], minlength=V)
        assert chi_square_pvalue(counts, probs) < 1e-6, name


def test_chi_square_pvalue_known_values():
    # chi-square survival function: df=1, x=3.841 -> 0.05 ; df=10, x=18.307 -> 0.05
    f = lambda df, x: float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(x / 2.0, dtype=torch.float64)))  # noqa: E731
    assert f(1, 3.841459) == pytest.approx(0.05, rel=1e-4)
    assert f(10, 18.307038) == pytest.approx(0.05, rel=1e-4)


def test_stream_steps_are_independent(draws):
    """Consecutive steps of one seeded request: P(top token at t+1) does not depend on step t
    (2x2 contingency chi-square, df=1)."""
    names, tok, _ = draws
    top = np.argmax(LOGITS)
    s = tok[names == "stream"] == top
    a, b = s[:-1], s[1:]
    table = np.array([[np.sum(a & b), np.sum(a & ~b)], [np.sum(~a & b), np.sum(~a & ~b)]], dtype=np.float64)
    exp = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - exp) ** 2 / exp).sum())
    pval = float(torch.special.gammaincc(torch.tensor(0.5, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    assert pval > P_MIN


def test_greedy_rows_take_argmax(draws):
    names, tok, _ = draws
    assert (tok[names == "greedy"] == np.argmax(LOGITS)).all()


def test_seeded_rows_reproducible_and_batch_independent(draws):
    """Re-drawing a slice of rows on their own (other batch size, other neighbours) gives the
    same tokens: each draw depends only on (logits row, settings, seed, offset)."""
    names, tok, prm = draws
    B = len(tok)
    idx = torch.tensor([0, 1, 5 * N + 3, B - 2, B - 1, 3 * N + 17, 6 * N + 100])
    sub = {k: v[idx.to(DEVICE)] for k, v in prm.items()}
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(len(idx), V).contiguous().to(DEVICE)
    again = _draw(logits, sub, use_triton=True)
    assert (again == tok[idx.numpy()]).all()

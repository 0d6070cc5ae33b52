"""Open-loop arrivals: gamma gaps with the requested mean rate and burstiness (seeded)."""
import numpy as np
import pytest

from draftwise.lab.arrivals import LoadLevel, arrival_times, gamma_gaps, parse_levels


@pytest.mark.parametrize("rate,burstiness", [(2.0, 1.0), (10.0, 0.25), (0.5, 4.0)])
def test_gamma_gaps_rate_and_burstiness(rate, burstiness):
    n = 20000
    gaps = gamma_gaps(n, rate, burstiness, seed=7)
    mean, cv2 = gaps.mean(), gaps.var() / gaps.mean() ** 2
    # mean gap 1/rate within 4 standard errors; CV^2 = 1/burstiness within 10%
    se = (1 / rate) * np.sqrt(1 / burstiness) / np.sqrt(n)
    assert abs(mean - 1 / rate) < 4 * se
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)


def test_poisson_gaps_are_exponential():
    from scipy import stats

    gaps = gamma_gaps(5000, 3.0, 1.0, seed=1)
    assert stats.kstest(gaps, "expon", args=(0, 1 / 3.0)).pvalue > 0.01


def test_arrival_times_seeded_and_monotone():
    a = arrival_times(50, 4.0, 1.0, seed=3)
    assert a == arrival_times(50, 4.0, 1.0, seed=3) and a[0] == 0.0
    assert all(x < y for x, y in zip(a, a[1:]))
    assert a != arrival_times(50, 4.0, 1.0, seed=4)


def test_parse_levels():
    lv = parse_levels("1,4", "0.5", 2.0)
    assert lv == [LoadLevel("concurrency", 1), LoadLevel("concurrency", 4), LoadLevel("rate", 0.5, 2.0)]
    assert [x.label for x in lv] == ["c=1", "c=4", "rate=0.5,b=2"]
    for bad in (("0", None, 1.0), (None, "-1", 1.0), (None, "1", 0.0)):
        with pytest.raises(ValueError):
            parse_levels(*bad)

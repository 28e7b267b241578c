"""Statistics: mean with a Student-t 95% confidence interval (t_{0.975, n-1}; scipy's quantile where it is
installed, else a table and the Cornish-Fisher expansion)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

# t_{0.975, dof} for dof 1..30 (to 4 decimals; a few seeds is the usual case). Beyond, the Cornish-Fisher
# expansion around the normal quantile is good to 1e-4.
T_975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)
Z_975 = 1.959963985


def t_quantile_975(dof: int) -> float:
    """The 0.975 quantile of Student's t with `dof` degrees of freedom (scipy's when it is installed)."""
    if dof < 1:
        raise ValueError(f"t quantile needs dof >= 1, got {dof}")
    try:
        from scipy.stats import t as student_t
    except ImportError:  # not a dependency of the project: the table and the expansion
        if dof <= len(T_975):
            return T_975[dof - 1]
        z, v = Z_975, float(dof)
        return (z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
                + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3))
    return float(student_t.ppf(0.975, dof))


@dataclass(frozen=True)
class Estimate:
    mean: Optional[float]
    half_width: Optional[float]  # of the 95% CI; None below two values
    n: int

    @property
    def interval(self) -> Optional[Tuple[float, float]]:
        if self.mean is None or self.half_width is None:
            return None
        return self.mean - self.half_width, self.mean + self.half_width


def mean_ci(values: Sequence[float]) -> Estimate:
    """Mean and 95% CI half-width t_{0.975,n-1} * s / sqrt(n), s the sample standard deviation."""
    n = len(values)
    if n == 0:
        return Estimate(None, None, 0)
    mean = sum(values) / n
    if n == 1:
        return Estimate(mean, None, 1)
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return Estimate(mean, t_quantile_975(n - 1) * math.sqrt(variance / n), n)

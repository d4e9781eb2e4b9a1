"""Least squares for the fabric model's few parameters: Levenberg-Marquardt on numpy, with uncertainties.

scipy is not a dependency; the fits here have at most ~10 parameters and a few hundred residuals, so a
numerical Jacobian and a damped Gauss-Newton step are enough. Parameters are fitted as logarithms (every
physical parameter here is positive), so uncertainties come back relative.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# A Jacobian column this small (d residual / d log parameter, summed over residuals) means no residual moves
# with the parameter: the data cannot constrain it.
UNCONSTRAINED = 1e-6


@dataclass
class Fit:
    """Fitted log-parameters, their covariance, and the residuals at the solution."""

    log_x: np.ndarray  # [k] natural logs of the fitted values
    covariance: np.ndarray  # [k, k] of log_x (s^2 (J^T J)^-1, s^2 = residual variance)
    residuals: np.ndarray  # [m] at the solution
    iterations: int

    @property
    def values(self) -> np.ndarray:
        return np.exp(self.log_x)

    @property
    def relative_sigma(self) -> np.ndarray:
        """One-sigma relative uncertainty of each value (the sigma of its logarithm)."""
        return np.sqrt(np.clip(np.diag(self.covariance), 0.0, None))


def jacobian(
    residual: Callable[[np.ndarray], np.ndarray],
    log_x: np.ndarray,
    step: float = 1e-4,
    at: np.ndarray | None = None,
) -> np.ndarray:
    """Forward-difference Jacobian [m, k] of ``residual`` in log-parameter space (``at``: the residual
    at ``log_x`` when the caller has it)."""
    base = residual(log_x) if at is None else at
    columns = []
    for j in range(log_x.size):
        up = log_x.copy()
        up[j] += step
        columns.append((residual(up) - base) / step)
    return np.stack(columns, axis=1)


def unconstrained(jac: np.ndarray) -> list[int]:
    """Indices of parameters no residual depends on (a zero Jacobian column)."""
    return [j for j in range(jac.shape[1]) if float(np.abs(jac[:, j]).max(initial=0.0)) < UNCONSTRAINED]


def levenberg_marquardt(
    residual: Callable[[np.ndarray], np.ndarray],
    log_x0: np.ndarray,
    max_iterations: int = 50,
    bounds: tuple[np.ndarray, np.ndarray] | None = None,
) -> Fit:
    """Minimize sum(residual(log_x)^2) from ``log_x0``; ``bounds`` clip log_x (an efficiency <= 1)."""
    x = np.array(log_x0, dtype=np.float64)
    low, high = bounds if bounds is not None else (np.full_like(x, -np.inf), np.full_like(x, np.inf))
    x = np.clip(x, low, high)
    r = residual(x)
    cost = float(r @ r)
    damping = 1e-3
    iterations = 0
    while iterations < max_iterations:
        iterations += 1
        jac = jacobian(residual, x, at=r)
        normal = jac.T @ jac
        gradient = jac.T @ r
        improved = False
        for _ in range(12):
            step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -gradient)
            trial = np.clip(x + step, low, high)
            r_trial = residual(trial)
            cost_trial = float(r_trial @ r_trial)
            if cost_trial < cost:
                x, r, improved = trial, r_trial, cost - cost_trial > 1e-12 * max(cost, 1e-30)
                cost = cost_trial
                damping = max(damping / 3, 1e-9)
                break
            damping *= 4
        if not improved:
            break
    jac = jacobian(residual, x, at=r)
    dof = max(r.size - x.size, 1)
    variance = float(r @ r) / dof
    covariance = variance * np.linalg.pinv(jac.T @ jac)
    return Fit(x, covariance, r, iterations)

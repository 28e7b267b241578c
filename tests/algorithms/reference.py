"""A deliberately plain reference of DESIGN.md's equations: Python loops over floats, no vectorisation.

The package's tensor code is checked against this; the two share no code.
"""
import math
import statistics


def ref_capabilities(R):
    return [statistics.fmean(x for row in R[k] for x in row) for k in range(len(R))]


def ref_omega(P, clamp=(0.1, 10.0)):
    Pf = [max(p, 1e-8) for p in P]
    out = []
    for k in range(len(P)):
        row = []
        for j in range(len(P)):
            w = Pf[k] / Pf[j]
            if clamp is not None:
                w = min(max(w, clamp[0]), clamp[1])
            row.append(w)
        out.append(row)
    return out


def ref_advantages(R, omega, capability_aware=True, eps=1e-6, guards=True):
    n, B, G = len(R), len(R[0]), len(R[0][0])
    A = [[[[0.0] * G for _ in range(B)] for _ in range(n)] for _ in range(n)]
    for b in range(B):
        group = [R[j][b][i] for j in range(n) for i in range(G)]
        sigma = statistics.stdev(group)
        plain = statistics.fmean(group)
        for k in range(n):
            if capability_aware:
                mu = sum(omega[k][j] * R[j][b][i] for j in range(n) for i in range(G)) / (n * G)
            else:
                mu = plain
            if guards and mu > max(group):
                mu = statistics.fmean(R[k][b])
            if guards and len(set(group)) == 1:
                mu = plain
            for j in range(n):
                for i in range(G):
                    A[k][j][b][i] = (R[j][b][i] - mu) / (sigma + eps)
    return A


def ref_seq_loss(logps, old_mean, adv, cross, m, eps_low=3e-4, eps_high=4e-4, alpha=1.0, delta=0.2, delta_step=0.025):
    """Loss value of one sequence (floats); logps are its response-token log-probs."""
    log_s = min(sum(logps) / len(logps) - old_mean, 10.0)
    s = math.exp(log_s)
    if not cross:
        clipped = min(max(s, 1 - eps_low), 1 + eps_high)
        return -min(s * adv, clipped * adv)
    lo = min(1.0, 1 - delta + m * delta_step)
    return -min(max(s, lo), 1.0) * s**alpha * adv

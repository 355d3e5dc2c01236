"""A BLAS-heavy numpy step: eigenvalues of a seeded 160x160 symmetric matrix."""
import numpy as np


def process(seed):
    a = np.random.default_rng(seed).normal(size=(160, 160))
    values = np.linalg.eigh(a @ a.T)[0]
    return {"seed": seed, "largest": float(values[-1]), "trace": float(values.sum())}

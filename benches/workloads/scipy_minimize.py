"""scipy.optimize.minimize of the Rosenbrock function from a seeded start."""
import numpy as np
from scipy.optimize import minimize, rosen, rosen_der


def process(seed):
    x0 = np.random.default_rng(seed).uniform(-2, 2, size=5)
    found = minimize(rosen, x0, jac=rosen_der, method="BFGS")
    return {"seed": seed, "fun": float(found.fun), "nit": int(found.nit)}

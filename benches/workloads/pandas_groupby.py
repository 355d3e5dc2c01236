"""A pandas groupby-aggregate over a seeded frame of 20,000 rows."""
import numpy as np
import pandas as pd


def process(seed):
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(
        {
            "key": rng.integers(0, 50, 20_000),
            "a": rng.normal(size=20_000),
            "b": rng.uniform(size=20_000),
        }
    )
    summary = frame.groupby("key").agg(a_mean=("a", "mean"), b_max=("b", "max"), n=("a", "size"))
    return {"seed": seed, "a_mean": float(summary["a_mean"].sum()), "n": int(summary["n"].sum())}

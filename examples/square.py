"""A node to sweep: what it returns for each grid point is one result line.

    fluksio-zygote sweep examples/square.py --grid x=0..999
"""


def process(x, offset=0):
    return {"x": x, "square": x * x + offset}

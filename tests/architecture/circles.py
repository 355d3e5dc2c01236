"""The circles between a Rust crate's files: which file names which (a
`crate::`, `super::` or `self::` path, a `use` of one, a parent naming a
child module it declares), and the groups of files that reach each other.

Usage: python3 circles.py SRC_DIR. Prints each circle, its files and the
edges inside it, then "N circles". Comments and `#[cfg(test)]` modules do
not count: a test may reach anywhere.
"""
import collections
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "src"

# The module path of each file: src/a/b.rs and src/a/b/mod.rs are ("a", "b").
files = {}
for directory, _, names in os.walk(root):
    for name in names:
        if name.endswith(".rs"):
            path = os.path.join(directory, name)
            parts = os.path.relpath(path, root)[:-3].split("/")
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            files[tuple(parts)] = path


def file_of(path):
    """The file that defines the longest prefix of a module path."""
    for n in range(len(path), 0, -1):
        if tuple(path[:n]) in files:
            return tuple(path[:n])
    return None


IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
PATH = re.compile(r"\b(crate|super|self)((?:::" + IDENT + r")+)")
USE_GROUP = re.compile(r"use\s+(crate|super|self)::\{([^;]*)\};", re.S)
CHILD = re.compile(r"(?:pub(?:\([a-z]+\))?\s+)?mod\s+(" + IDENT + r")\s*;")

edges = collections.defaultdict(set)
for module, path in files.items():
    text = open(path).read()
    text = re.split(r"#\[cfg\(test\)\]", text)[0]
    text = re.sub(r"//[^\n]*", "", text)
    def add(kind, segments):
        # `super` of a::b (a/b.rs or a/b/mod.rs) is a; `self` is a::b.
        base = {"crate": [], "super": list(module[:-1]), "self": list(module)}[kind]
        found = file_of(base + segments)
        if found is not None and found != module and found != ():
            edges[module].add(found)

    for match in PATH.finditer(text):
        add(match.group(1), match.group(2).split("::")[1:])
    for match in USE_GROUP.finditer(text):
        for item in re.split(r",\s*", match.group(2)):
            segments = [s for s in item.split("{")[0].strip().split("::") if re.fullmatch(IDENT, s)]
            if segments:
                add(match.group(1), segments)
    for child in CHILD.findall(text):
        if re.search(r"(?<![:\w])" + child + r"::", text) or re.search(r"use\s+" + child + r"\b", text):
            found = file_of(list(module) + [child])
            if found is not None and found != module:
                edges[module].add(found)

# Tarjan's strongly connected components.
index, low, stack, on_stack, circles = {}, {}, [], set(), []
counter = [0]
sys.setrecursionlimit(10000)


def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in edges[v]:
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on_stack:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        group = []
        while True:
            w = stack.pop()
            on_stack.discard(w)
            group.append(w)
            if w == v:
                break
        if len(group) > 1:
            circles.append(group)


for v in list(files):
    if v not in index:
        visit(v)
for group in circles:
    print(len(group), "files:", ", ".join(sorted("/".join(m) or "lib" for m in group)))
    for a in group:
        for b in edges[a]:
            if b in group:
                print("   ", "/".join(a), "->", "/".join(b))
print(len(circles), "circles")

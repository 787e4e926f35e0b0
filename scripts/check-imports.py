#!/usr/bin/env python3
"""Fails on an import circle between the top-level modules of each crate.

A module's imports are the `crate::<module>` paths in its files, outside
comments and tests (a test may drive a lower module through a higher one).
With no circle the modules have one order, lowest first, which is printed
so a change that reverses a layer shows in review.
"""
import os
import re
import sys
from collections import defaultdict

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CRATES = ["src", "routing/src", "loadtest/src"]
TEST_MODULE = re.compile(r"#\[cfg\(test\)\]\s*mod \w+\s*\{.*", re.S)


def modules(src):
    names = set()
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if entry.endswith(".rs") and entry not in ("lib.rs", "main.rs"):
            names.add(entry[:-3])
        elif os.path.isdir(path):
            names.add(entry)
    return names


def imports(src, names):
    graph = defaultdict(set)
    for folder, _, files in os.walk(src):
        for file in files:
            if not file.endswith(".rs") or file == "tests.rs":
                continue
            path = os.path.join(folder, file)
            owner = os.path.relpath(path, src).split(os.sep)[0].removesuffix(".rs")
            if owner not in names:
                continue
            text = open(path, encoding="utf-8").read()
            text = TEST_MODULE.sub("", text)
            code = "\n".join(l for l in text.splitlines() if not l.strip().startswith("//"))
            used = set(re.findall(r"crate::(\w+)", code))
            for group in re.findall(r"crate::\{([^}]*)\}", code):
                used.update(re.findall(r"(?:^|,)\s*(\w+)", group))
            graph[owner].update(used & names - {owner})
    return graph


def order(names, graph):
    """The modules lowest first, or the modules left on a circle."""
    placed, left = [], set(names)
    while left:
        free = sorted(m for m in left if not (graph[m] & left))
        if not free:
            # Trim what only sits above the circle, to name the circle alone.
            while above := {m for m in left if not any(m in graph[o] for o in left)}:
                left -= above
            return None, left
        placed += free
        left -= set(free)
    return placed, set()


def main():
    failed = False
    for crate in CRATES:
        src = os.path.join(ROOT, crate)
        if not os.path.isdir(src):
            continue
        names = modules(src)
        graph = imports(src, names)
        layers, circle = order(names, graph)
        if layers is None:
            failed = True
            print(f"{crate}: import circle among {sorted(circle)}:")
            for m in sorted(circle):
                print(f"  {m} -> {sorted(graph[m] & circle)}")
        else:
            print(f"{crate}: no import circle; lowest first: {' '.join(layers)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

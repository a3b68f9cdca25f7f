#!/usr/bin/env python3
"""The `use crate::` graph of a crate's modules, and whether it has a loop.

Reads every `.rs` file under SRC (default core/src), outside `#[cfg(test)]`
modules, and records which modules each one imports (`use crate::a::b`,
`use super::x`, `crate::a::f(..)` paths in code). A module is a file: a path
is cut at the first file it reaches. Exits 1 and names the loop when a module
imports one that imports it back, directly or through others.

    scripts/module-graph.py [SRC] [--print]
"""
import os
import re
import sys


def modules(src):
    """Maps a module path ('limiter::decide') to its file."""
    found = {}
    for root, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, name), src)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            found["::".join(rel)] = os.path.join(root, name)
    return found


def without_tests(text):
    """The file's code without comments and `#[cfg(test)]` items (a test may
    import anything; a doc link is not an import)."""
    out, skip_depth, depth, pending = [], None, 0, False
    for line in text.splitlines():
        line = re.sub(r"//.*", "", line)
        stripped = line.strip()
        if skip_depth is None and stripped.startswith("#[cfg(test)]"):
            pending = True
            continue
        opens, closes = line.count("{"), line.count("}")
        if pending:
            pending = False
            if opens == 0 and stripped.endswith(";"):
                continue  # `mod testing;` and the like
            skip_depth = depth
        if skip_depth is None:
            out.append(line)
        depth += opens - closes
        if skip_depth is not None and depth <= skip_depth:
            skip_depth = None
    return "\n".join(out)


def resolve(path, here, known):
    """The module a `crate::`/`super::` path names, cut at the deepest known module."""
    parts = path.split("::")
    if parts[0] == "crate":
        base, parts = [], parts[1:]
    elif parts[0] == "super":
        base = here.split("::")[:-1] if here else []
        parts = parts[1:]
        while parts and parts[0] == "super":
            base, parts = base[:-1], parts[1:]
    else:
        return None
    best = None
    for i in range(len(parts) + 1):
        candidate = "::".join(base + parts[:i])
        if candidate in known:
            best = candidate
    return best


def test_only(known):
    """Modules declared only for tests (`#[cfg(test)] mod testing;`)."""
    found = set()
    for module, path in known.items():
        text = open(path, encoding="utf-8").read()
        for child in re.findall(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text):
            found.add(f"{module}::{child}" if module else child)
    return found


def graph(src):
    known = modules(src)
    for module in test_only(known):
        known.pop(module, None)
    edges = {m: set() for m in known}
    for module, path in known.items():
        text = without_tests(open(path, encoding="utf-8").read())
        paths = []
        for use in re.findall(r"\buse\s+((?:crate|super)(?:::\w+)*)(?:::\{([^;]*)\})?\s*(?:as\s+\w+)?;", text, re.S):
            head, group = use
            if group:
                # `use crate::a::{b, c::{d}}`: each member may name a module.
                for member in re.split(r",", re.sub(r"\{[^}]*\}", "", group)):
                    member = member.strip().split(" as ")[0].strip()
                    if member and member != "self":
                        paths.append(f"{head}::{member}")
            paths.append(head)
        paths += re.findall(r"\b((?:crate|super)(?:::\w+)+)", text)
        for p in paths:
            target = resolve(p, module, known)
            # A module declares its children (and may re-export their
            # items): that is not an import. A child's use of an ancestor is.
            is_descendant = target is not None and (module == "" or target.startswith(module + "::"))
            if target is not None and target != module and not is_descendant:
                edges[module].add(target)
    return edges


def find_loop(edges):
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    src = args[0] if args else "core/src"
    edges = graph(src)
    if "--print" in sys.argv:
        for module in sorted(edges):
            print(f"{module or '(crate root)'} -> {', '.join(sorted(t or '(crate root)' for t in edges[module])) or '-'}")
    cycle = find_loop(edges)
    if cycle:
        print(f"{src}: import loop: {' -> '.join(cycle)}", file=sys.stderr)
        sys.exit(1)
    print(f"{src}: {len(edges)} modules, no import loop")


if __name__ == "__main__":
    main()

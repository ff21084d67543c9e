#!/usr/bin/env python3
"""Layout checks for quorumlock's library crate (src/, the `quorumlock` binary aside).

1. No import circles: module A depends on module B when A's production code (test-only
   items left out) names B by a `crate::`, `super::` or `self::` path. Re-exports in a
   folder's `mod.rs` (`pub use`, `pub(crate) use`) are the folder's face to the outside,
   not a dependency, and the crate root is not a node. Any strongly connected component
   of two or more modules fails the check.
2. No library function over MAX_FN_LINES lines (its signature to its closing brace),
   outside the tests and the simulation (src/testing, *_tests.rs, tests.rs, test-only
   items): a function should read in one screen. (Files are sized by concept, not capped.)

`--graph` prints every module's production dependencies, one line each, and the totals.
"""

import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
MAX_FN_LINES = 100

IDENT = r"[a-z_][a-z0-9_]*"


def module_of(rel):
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return "::".join(parts)


def production_lines(lines):
    """The lines outside `#[cfg(test)]` items (a module, fn, use, impl or struct)."""
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"\s*#\[cfg\((test|doctest)\)\]\s*$", line):
            # Skip the attributes and the item that follows.
            j = i + 1
            while j < len(lines) and re.match(r"\s*#\[", lines[j]):
                j += 1
            depth = 0
            opened = False
            while j < len(lines):
                code = strip_comment(lines[j])
                depth += code.count("{") - code.count("}")
                opened = opened or "{" in code
                if (opened and depth <= 0) or (not opened and code.rstrip().endswith(";")):
                    break
                j += 1
            i = j + 1
            continue
        out.append(line)
        i += 1
    return out


def long_functions(lines):
    """(name, line, length) of each function longer than MAX_FN_LINES: from its `fn` line to
    the closing brace at the same indentation (declarations without a body are skipped)."""
    found = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)(pub(\([^)]*\))?\s+)?(const\s+|unsafe\s+)*fn\s+(\w+)", line)
        if not m:
            continue
        indent = m.group(1)
        j = i
        while j < len(lines) and not re.search(r"[{;]\s*$", strip_comment(lines[j])):
            j += 1
        if j >= len(lines) or strip_comment(lines[j]).rstrip().endswith(";"):
            continue
        for k in range(j, len(lines)):
            if lines[k] == indent + "}":
                if k - i + 1 > MAX_FN_LINES:
                    found.append((m.group(5), i + 1, k - i + 1))
                break
    return found


def strip_comment(line):
    # Good enough for this code base: no `//` inside the strings that name paths.
    s = line.split("//", 1)[0]
    return re.sub(r'"(\\.|[^"\\])*"', '""', s)


def split_group(text, start):
    """Parses a `{...}` group at text[start] into its top-level paths; returns (paths, end)."""
    assert text[start] == "{"
    depth, i, cur, paths = 0, start, "", []
    while i < len(text):
        c = text[i]
        if c == "{":
            depth += 1
            if depth > 1:
                cur += c
        elif c == "}":
            depth -= 1
            if depth == 0:
                paths.append(cur)
                return [p.strip() for p in paths if p.strip()], i
            cur += c
        elif c == "," and depth == 1:
            paths.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    return [p.strip() for p in paths if p.strip()], i


def expand(prefix, rest):
    """Every full path named by `prefix::rest`, where rest may open a group."""
    rest = rest.strip()
    if rest.startswith("{"):
        inner, _ = split_group(rest, 0)
        out = []
        for p in inner:
            m = re.match(rf"({IDENT}(?:::{IDENT})*)(?:::(\{{.*))?", p, re.S)
            if not m:
                # An item (a type, a constant) of the prefix itself.
                out.append(prefix)
                continue
            if m.group(2):
                out += expand(prefix + [*m.group(1).split("::")], m.group(2))
            else:
                out.append(prefix + m.group(1).split("::"))
        return out
    m = re.match(rf"({IDENT}(?:::{IDENT})*)(?:::(\{{.*))?", rest, re.S)
    if not m:
        return [prefix]
    if m.group(2):
        return expand(prefix + m.group(1).split("::"), m.group(2))
    return [prefix + m.group(1).split("::")]


def references(mod, text, modules):
    """The modules `mod`'s code names."""
    found = set()
    here = mod.split("::") if mod else []
    for m in re.finditer(r"\b(crate|super|self)((?:::super)*)::", text):
        kind, supers = m.group(1), m.group(2).count("super")
        if kind == "crate":
            base = []
        elif kind == "super":
            base = here[: len(here) - 1 - supers]
        else:
            base = here + [] if supers == 0 else here[: len(here) - supers]
        rest = text[m.end():]
        if rest.startswith("{"):
            _, end = split_group(rest, 0)
            paths = expand(base, rest[: end + 1])
        else:
            pm = re.match(rf"{IDENT}(?:::{IDENT})*(?:::\{{)?", rest)
            if not pm:
                continue
            frag = pm.group(0)
            if frag.endswith("{"):
                _, end = split_group(rest, len(frag) - 1)
                paths = expand(base, rest[: end + 1])
            else:
                paths = [base + frag.split("::")]
        for p in paths:
            # The longest prefix that is a module.
            for n in range(len(p), 0, -1):
                cand = "::".join(p[:n])
                if cand in modules:
                    if cand != mod:
                        found.add(cand)
                    break
    return found


def main():
    files = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        if os.path.relpath(dirpath, ROOT).split(os.sep)[0] == "bin":
            continue
        for f in filenames:
            if f.endswith(".rs"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                files[rel] = module_of(rel)
    modules = set(files.values())
    graph = {}
    problems = []
    for rel, mod in sorted(files.items()):
        with open(os.path.join(ROOT, rel)) as fh:
            lines = fh.read().split("\n")
        tests = rel.startswith("testing" + os.sep) or rel.endswith("_tests.rs") or \
            os.path.basename(rel) == "tests.rs"
        if not tests:
            for name, start, length in long_functions(production_lines(lines)):
                problems.append(f"{rel}: fn {name} is {length} lines (over {MAX_FN_LINES}; "
                                f"give its steps functions of their own)")
        if mod == "":
            continue
        prod = production_lines(lines)
        is_folder = rel.endswith("mod.rs")
        code = []
        for line in prod:
            s = strip_comment(line)
            if re.match(r"\s*//", line):
                continue
            if is_folder and re.match(r"\s*pub(\([a-z]+\))?\s+use\b", s):
                continue
            code.append(s)
        graph[mod] = references(mod, "\n".join(code), modules) - {""}

    # Tarjan's strongly connected components.
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    for comp in comps:
        edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        problems.append("import circle: " + "; ".join(edges))

    if "--graph" in sys.argv:
        for v in sorted(graph):
            print(f"{v}: {', '.join(sorted(graph[v]))}")
        print(f"{len(graph)} modules, {sum(len(d) for d in graph.values())} import edges, "
              f"{len(comps)} circles")
    for p in problems:
        print(f"layout: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The graph of imports between the modules of src/, and its cycles (`-v` prints the graph).

A module is a file (foo.rs or foo/mod.rs). Module A depends on module B when A's code
(not its comments, not `#[cfg(doc)]` imports) names a path into B: `crate::b::..` (in
`use` groups too, nested ones included), `super::..`, or `use b::..` for a child B (a
parent that re-exports its child depends on it). An item of the crate root counts as a
dependency on the root. Inside an inline module (`mod tests { .. }`), `super` is the file's
own module. Prints every strongly connected component of more than one module; exits 1 if
there is one.
"""
import os, re, sys

root = sys.argv[1] if len(sys.argv) > 1 else "src"
files = {}
for dirpath, _, names in os.walk(root):
    for n in names:
        if n.endswith(".rs"):
            path = os.path.join(dirpath, n)
            rel = os.path.relpath(path, root)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib"):
                rel = rel[:-1]
            files[tuple(rel)] = path
mods = set(files)

def resolve(segments):
    """The longest module prefix of a crate path."""
    best = None
    for i in range(1, len(segments) + 1):
        if tuple(segments[:i]) in mods:
            best = tuple(segments[:i])
    return best

deps = {m: set() for m in mods}
path_re = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
for m, path in files.items():
    text = open(path).read()
    lines = []
    skip_next_use = False
    for line in text.split("\n"):
        s = line.strip()
        if s.startswith("//"):
            continue
        if s.startswith("#[cfg(doc)]"):
            skip_next_use = True
            continue
        if skip_next_use:
            skip_next_use = not s.endswith(";")
            continue
        lines.append(line.split("//")[0])
    code = "\n".join(lines)
    # Inside an inline module (`mod tests { .. }`), `super` is this module itself.
    inline = re.search(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod \w+ \{", code, re.M)
    if inline:
        at = inline.start()
        code = code[:at] + code[at:].replace("super::", "self::")
    refs = []
    def split_top(body):
        out, depth, cur = [], 0, ""
        for ch in body:
            if ch == "{": depth += 1
            if ch == "}": depth -= 1
            if ch == "," and depth == 0:
                out.append(cur.strip()); cur = ""
            else:
                cur += ch
        if cur.strip(): out.append(cur.strip())
        return out
    def expand(prefix, item):
        """Every path a `use` tree names, nested groups included."""
        if "::{" in item:
            head, body = item.split("::{", 1)
            body = body[: body.rfind("}")]
            for inner in split_top(body):
                expand(prefix + "::" + head, inner)
        else:
            refs.append(prefix + "::" + item.split(" as ")[0])
    for g in re.finditer(r"\buse\s+((?:crate|super)(?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{", code):
        start = g.end(); depth = 1; i = start
        while depth and i < len(code):
            if code[i] == "{": depth += 1
            elif code[i] == "}": depth -= 1
            i += 1
        for item in split_top(code[start:i-1]):
            expand(g.group(1), item)
    code = re.sub(r"pub\(in [^)]*\)", "pub", code)
    for r in path_re.finditer(code):
        # `crate::a::{..}` names its items inside the braces, handled above.
        if code.startswith("::{", r.end()):
            continue
        refs.append(r.group(1) + r.group(2))
    # `use child::..` and `pub use child::..`: paths relative to this module.
    children = {c[-1] for c in mods if len(c) == len(m) + 1 and c[:len(m)] == m}
    for u in re.finditer(r"\buse\s+([A-Za-z_][A-Za-z0-9_]*)::", code):
        if u.group(1) in children:
            refs.append("crate::" + "::".join(list(m) + [u.group(1)]))
    for ref in refs:
        segs = [s for s in ref.split("::") if s and s != "self"]
        base = segs[0]
        rest = segs[1:]
        if base == "crate":
            # An item of the crate root (a re-export) is a dependency on the root.
            target = resolve(rest) or (() if rest else None)
        else:
            # `super` is the parent module, for foo.rs and foo/mod.rs alike.
            parent = list(m)[:-1]
            while rest and rest[0] == "super":
                parent = parent[:-1]; rest = rest[1:]
            target = resolve(parent + rest) or (tuple(parent) if tuple(parent) in mods else None)
        if target is not None and target != m and not (target == () and m == ()):
            deps[m].add(target)

# Tarjan
index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)
def visit(v):
    index[v] = low[v] = counter[0]; counter[0] += 1
    stack.append(v); on.add(v)
    for w in deps[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        comps.append(comp)
for v in sorted(mods):
    if v not in index:
        visit(v)
name = lambda m: "::".join(m) or "crate"
cycles = [c for c in comps if len(c) > 1]
if "-v" in sys.argv:
    for m in sorted(mods):
        print(f"{name(m)} -> {', '.join(sorted(name(d) for d in deps[m]))}")
for c in cycles:
    print("cycle:", ", ".join(sorted(name(m) for m in c)))
    for m in sorted(c):
        print("   ", name(m), "->", ", ".join(sorted(name(d) for d in deps[m] if d in c)))
print(f"{len(mods)} modules, {sum(len(d) for d in deps.values())} dependencies, {len(cycles)} cycles")
sys.exit(1 if cycles else 0)

#!/usr/bin/env python3
"""Offline checks of the locked dependency tree, as a user builds it.

    .ci/deps-check.py            # from the repository root; exit 1 on a problem

What a user's build compiles is the normal and build dependencies of
quorumlock and of its command (quorumlock-cli) with every feature on, on any
target (`cargo tree -e normal,build --all-features --target all`);
dev-dependencies, the benches and the examples are not part of it. For that
tree:

- msrv:     no package declares a `rust-version` above ours (Cargo.toml's
            `package.rust-version`): the lockfile must build on the MSRV.
- licenses: every package's license expression can be met with the licenses
            in ALLOWED (each OR takes its best side, each AND needs both).
- sources:  every package comes from crates.io (no git, no other registry).
- bans:     two versions of one crate are reported (a duplicate costs build
            time); those in DUPLICATES_OK are known and allowed, others fail.

Security advisories need the RustSec database, which this machine cannot
reach: run `cargo audit` (or `cargo deny check advisories`) where the
network allows, before a release (see RELEASE.md).
"""

import json
import re
import subprocess
import sys

ALLOWED = {
    "MIT",
    "Apache-2.0",
    "Apache-2.0 WITH LLVM-exception",
    "BSD-2-Clause",
    "BSD-3-Clause",
    "ISC",
    "Zlib",
    "Unicode-3.0",
    "Unicode-DFS-2016",
    "CC0-1.0",
    "Unlicense",
    "BSL-1.0",
    "MPL-2.0",
    "CDLA-Permissive-2.0",
}

# Crates whose two versions in the tree are known and cannot be merged by us
# (each comes from a different dependency's own requirement).
DUPLICATES_OK = {
    # windows-sys / getrandom pairs come from dependencies' own requirements
    # and are only built on the platforms that need them.
    "windows-sys",
    "windows-targets",
    "windows_aarch64_gnullvm",
    "windows_aarch64_msvc",
    "windows_i686_gnu",
    "windows_i686_gnullvm",
    "windows_i686_msvc",
    "windows_x86_64_gnu",
    "windows_x86_64_gnullvm",
    "windows_x86_64_msvc",
    "getrandom",
    "r-efi",
    "wasi",
}

CRATES_IO = "registry+https://github.com/rust-lang/crates.io-index"


def run(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def version_key(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3]) + (0,) * 3


def satisfiable(expr):
    """Whether an SPDX expression can be met with ALLOWED licenses."""
    tokens = re.findall(r"\(|\)|[^\s()]+(?: WITH [^\s()]+)?", expr.replace("/", " OR "))

    def parse_or(i):
        ok, i = parse_and(i)
        while i < len(tokens) and tokens[i] == "OR":
            right, i = parse_and(i + 1)
            ok = ok or right
        return ok, i

    def parse_and(i):
        ok, i = parse_atom(i)
        while i < len(tokens) and tokens[i] == "AND":
            right, i = parse_atom(i + 1)
            ok = ok and right
        return ok, i

    def parse_atom(i):
        if tokens[i] == "(":
            ok, i = parse_or(i + 1)
            return ok, i + 1  # ")"
        return tokens[i] in ALLOWED, i + 1

    try:
        ok, i = parse_or(0)
        return ok and i == len(tokens)
    except IndexError:
        return False


def main():
    meta = json.loads(run("cargo", "metadata", "--format-version", "1", "--all-features", "--locked"))
    root = next(p for p in meta["packages"] if p["name"] == "quorumlock")
    ours = root.get("rust_version")
    by_name_version = {(p["name"], p["version"]): p for p in meta["packages"]}
    tree = run(
        "cargo", "tree", "--locked", "-e", "normal,build", "--all-features",
        "-p", "quorumlock", "-p", "quorumlock-cli",
        "--target", "all", "--prefix", "none", "--format", "{p}",
    )
    seen = set()
    for line in tree.splitlines():
        m = re.match(r"(\S+) v(\S+)", line.strip())
        if m:
            seen.add((m.group(1), m.group(2)))
    seen = {(n, v) for n, v in seen if n not in ("quorumlock", "quorumlock-cli")}
    problems = []
    if not ours:
        problems.append("msrv: Cargo.toml declares no package.rust-version")
    versions = {}
    for key in sorted(seen):
        p = by_name_version.get(key)
        if p is None:
            problems.append(f"metadata: {key[0]} {key[1]} not found")
            continue
        name, version = key
        versions.setdefault(name, []).append(version)
        rv = p.get("rust_version")
        if ours and rv and version_key(rv) > version_key(ours):
            problems.append(f"msrv: {name} {version} needs Rust {rv}, above our {ours}")
        lic = p.get("license") or ""
        if not satisfiable(lic):
            problems.append(f"licenses: {name} {version}: {lic or 'no license'}")
        if p.get("source") != CRATES_IO:
            problems.append(f"sources: {name} {version} comes from {p.get('source')}")
    dupes = {n: v for n, v in versions.items() if len(v) > 1}
    for name, vs in sorted(dupes.items()):
        line = f"bans: {name} appears twice: {', '.join(vs)}"
        if name in DUPLICATES_OK:
            print(f"note: {line} (known)")
        else:
            problems.append(line)
    print(f"{len(seen)} packages in the tree a user builds; MSRV {ours}")
    for p in problems:
        print(f"FAIL {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

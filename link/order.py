#!/usr/bin/env python3
"""Regenerates link/hot-functions.txt: the functions a running daemon executes, which build.rs
hands to the linker (`--symbol-ordering-file`) so that they sit together at the start of .text.

Why: the daemon's resident set is mostly its code pages, and a page is resident when any
function on it has run (the kernel also maps up to 64 KiB of cached neighbours on each fault).
Scattered over 16 MB of .text, the ~2.4 MB of code a daemon runs kept ~9 MiB resident; packed,
it keeps about what it is (benches/rss.rs).

How: the rss bench runs `nvdra run` under valgrind's callgrind (`RSS_WRAP`), once per mode,
for a few prepare/unprepare cycles and a SIGTERM; every function of the nvdra binary that
callgrind saw run is listed, sorted by (mangled) name, so that a regeneration's diff shows what
changed (the names, hashes included, stay the same across edits elsewhere in the code). Needs valgrind. Run from the repository root:

    python3 link/order.py

A stale list costs nothing but memory: names the binary no longer has are skipped by the
linker, and functions not in the list are laid out as before, after the listed ones.
"""

import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "link", "hot-functions.txt")
CYCLES = "30"


def bench_binary():
    """Builds the rss bench (release profile) and returns its executable."""
    out = subprocess.run(
        ["cargo", "bench", "--bench", "rss", "--no-run", "--message-format=json"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    for line in out.splitlines():
        if '"executable"' in line and '"rss"' in line:
            m = re.search(r'"executable":"([^"]+)"', line)
            if m:
                return m.group(1)
    sys.exit("order.py: cargo did not report the rss bench's executable")


def functions(bench, mode, workdir):
    """The nvdra functions callgrind saw run in `mode`, in the order it first names them."""
    report = os.path.join(workdir, f"callgrind.{mode}")
    # The tunable `nvdra run` would otherwise execute itself again to get (daemon::runtime),
    # which would leave valgrind behind.
    env = dict(os.environ, RSS_CYCLES=CYCLES, RSS_MODE=mode,
               GLIBC_TUNABLES="glibc.malloc.tcache_count=0", RSS_WRAP=(
        "valgrind --tool=callgrind --demangle=no --compress-strings=no "
        f"--compress-pos=no --callgrind-out-file={report}"))
    subprocess.run([bench], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    names, obj = [], None
    with open(report) as f:
        for line in f:
            if line.startswith("ob="):
                obj = line[3:].strip()
            elif line.startswith("fn=") and obj and obj.endswith("/nvdra"):
                # `'N` marks a recursion level; addresses stand for functions without a symbol.
                name = re.sub(r"'\d+$", "", line[3:].strip())
                if not name.startswith("0x") and not name.startswith("("):
                    names.append(name)
    return names


def main():
    bench = bench_binary()
    seen, order = set(), []
    with tempfile.TemporaryDirectory() as workdir:
        # Twice: the rss bench spawns target/release/nvdra, which `cargo bench` builds first
        # and `cargo build --release` (what the image ships) then replaces. Their symbols'
        # hashes differ (cargo gives the two builds different crate metadata), so the list holds
        # both spellings; the linker uses the ones the binary it links has.
        for build in [None, ["cargo", "build", "--release", "--locked"]]:
            if build:
                subprocess.run(build, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
            for mode in ["dra", "both"]:
                for name in functions(bench, mode, workdir):
                    if name not in seen:
                        seen.add(name)
                        order.append(name)
    if len(order) < 1000:
        sys.exit(f"order.py: only {len(order)} functions seen; did the daemon run?")
    with open(OUT, "w") as f:
        f.write("\n".join(sorted(order)) + "\n")
    print(f"order.py: {len(order)} functions in {os.path.relpath(OUT, ROOT)}")


if __name__ == "__main__":
    main()

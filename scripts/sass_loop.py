"""The main loop of compiled kernels, from their SASS: its size and its local-memory traffic.

A developer's check that needs no GPU: compile the decode kernels to a cubin, then

  nvcc -O3 --expt-relaxed-constexpr -std=c++17 -gencode arch=compute_90,code=sm_90 -cubin \\
      -DJTQ_DEV_ONLY_D=128 -Icuda_ops/include -I$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") \\
      cuda_ops/paged_decode.cu -o /tmp/pd.cubin
  python3 scripts/sass_loop.py /tmp/pd.cubin 'v4_kernelILi128ELi4ELb0ELb1ELi4ELi4ELi1ELi2EE'

For each kernel whose mangled name matches the regular expression it prints its main loop (the
first backward branch over 256 instructions or more that is not a divergence handler's): the
instructions in it, its common path per 16-token tile (where it has lazy-rescale votes, one per tile),
local loads / stores (LDL / STL: spills) and the most frequent opcodes. cuobjdump comes with the
CUDA toolkit or the `nvidia-cuda-cuobjdump` wheel (set CUOBJDUMP to its path).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess


def kernels(sass: str):
    """(mangled name, [(address, instruction)]) of each function in cuobjdump -sass output."""
    for chunk in sass.split("Function : ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        rows = [(int(m.group(1), 16), m.group(2).strip())
                for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s*([^;]*);", chunk)]
        yield name, rows


def main_loop(rows, min_instructions=256):
    """(address, instruction) rows of the first backward branch's span (not BRA.DIV) of at least
    min_instructions, or []. (The warp-divergence handlers after the body jump back too, over
    longer spans: the longest span is not the loop.)"""
    for addr, ins in rows:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", ins)
        if m and "DIV" not in ins:
            target = int(m.group(1), 16)
            if target < addr and (addr - target) // 16 >= min_instructions:
                return [(a, i) for a, i in rows if target <= a <= addr]
    return []


def rare_spans(loop):
    """(first, last) indices in the loop of each rare branch: the instructions a `VOTE.ANY P; ...; @!P BRA
    forward` skips when no lane votes (v4's lazy rescale, or the masked-token path around it, one per
    tile); branches nested in another are left out."""
    addr = {i: a for i, (a, _) in enumerate(loop)}
    spans = []
    for i in range(len(loop) - 1):
        vote = re.match(r"VOTE\.ANY (P\d), \1\b", loop[i][1])
        if not vote:
            continue
        for b in range(i + 1, min(i + 40, len(loop))):  # the branch, a few instructions later
            m = re.match(rf"@!{vote.group(1)} BRA (0x[0-9a-f]+)", loop[b][1])
            if m and int(m.group(1), 16) > addr[b]:
                target = int(m.group(1), 16)
                spans.append((b + 1, max(j for j in range(b + 1, len(loop)) if addr[j] < target)))
                break
    # A vote inside a rare branch (the lazy rescale inside the masked-token path) is part of it.
    return [s for s in spans if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in spans)]


def opcode(ins: str) -> str:
    words = ins.split()
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cubin")
    ap.add_argument("pattern", help="regular expression on the mangled kernel name")
    args = ap.parse_args()
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if tool is None:
        raise SystemExit("cuobjdump not found: set CUOBJDUMP (pip download nvidia-cuda-cuobjdump)")
    sass = subprocess.run([tool, "-sass", args.cubin], capture_output=True, text=True, check=True).stdout
    for name, rows in kernels(sass):
        if not re.search(args.pattern, name):
            continue
        loop = main_loop(rows)
        ops = collections.Counter(opcode(i) for _, i in loop)
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(8))
        print(f"{name}\n  loop: {len(loop)} instructions, LDL {ops['LDL']}, STL {ops['STL']}; {top}")
        spans = rare_spans(loop)
        if spans:
            common = len(loop) - sum(last - first + 1 for first, last in spans)
            print(f"  common path (rare rescale branches left out): {common / len(spans):.1f} per tile, "
                  f"{len(spans)} tiles")


if __name__ == "__main__":
    main()

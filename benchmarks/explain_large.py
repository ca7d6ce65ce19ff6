"""How fast, and in how much memory, `ddpdoctor explain` reads a big job's log.

Builds a log of 64 ranks interleaved (torchrun's `[rankN]:` prefixes): ordinary training
lines and NCCL INFO chatter as filler, and one real failure in the middle: rank 37
hits a CUDA out-of-memory error while the other 63 time out in the NCCL watchdog, with
the message texts of tests/fixtures/explain. Then runs `python -m ddpdoctor explain` on it
in a fresh process (plain and gzip) and reports wall time, peak RSS, and whether rank 37
was named. Run:

    python benchmarks/explain_large.py              # 100 MB
    python benchmarks/explain_large.py --mb 20      # quicker
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

RANKS = 64
CULPRIT = 37


def _filler(rng: random.Random, step: int, rank: int) -> str:
    kind = rng.random()
    if kind < 0.6:
        return (f"[rank{rank}]: step {step} loss {rng.uniform(1, 3):.4f} lr 3.0e-04 grad_norm {rng.uniform(0, 2):.3f} "
                f"tokens/s {rng.randint(9000, 12000)} mem_alloc 61.2GiB\n")
    if kind < 0.9:
        return (f"[rank{rank}]:node{rank // 8:02d}:{4000 + rank}:{4100 + rank} [{rank % 8}] NCCL INFO Channel "
                f"{rng.randint(0, 31):02d}/0 : {rank} -> {(rank + 1) % RANKS} via P2P/CUMEM/read\n")
    return f"[rank{rank}]: [W socket.cpp:663] [c10d] warning: retrying a step of the data loader ({step})\n"


def _failure() -> list[str]:
    lines = [f"[rank{CULPRIT}]: Traceback (most recent call last):\n",
             f"[rank{CULPRIT}]:   File \"/job/train.py\", line 88, in <module>\n",
             f"[rank{CULPRIT}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a "
             "total capacity of 79.10 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has "
             "78.03 GiB memory in use.\n"]
    for r in range(RANKS):
        if r != CULPRIT:
            lines.append(f"[rank{r}]:[E1123 10:00:{r % 60:02d}.000000000 ProcessGroupNCCL.cpp:632] [Rank {r}] "
                         "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4711, OpType=ALLREDUCE, "
                         "NumelIn=26214400, NumelOut=26214400, Timeout(ms)=600000) ran for 600081 milliseconds "
                         "before timing out.\n")
    return lines


def build(path: str, megabytes: int, seed: int = 7) -> int:
    rng = random.Random(seed)
    target = megabytes * 1_000_000
    written = 0
    failed = False
    step = 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            step += 1
            block = "".join(_filler(rng, step, r) for r in rng.sample(range(RANKS), RANKS))
            if not failed and written > target // 2:
                block += "".join(_failure())
                failed = True
            out.write(block)
            written += len(block)
    return written


def run(path: str) -> dict:
    cmd = [sys.executable, "-m", "ddpdoctor", "explain", path, "--json", path + ".json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"})
    seconds = time.monotonic() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with open(path + ".json", encoding="utf-8") as handle:
        report = json.load(handle)
    named = [f for f in report["findings"] if f["code"] == "LOG001" and f["ranks"] == [CULPRIT]]
    return {"file": os.path.basename(path), "bytes": os.path.getsize(path), "lines": report["inputs"]["lines"],
            "seconds": round(seconds, 2), "peak_rss_mib": round(max(peak_kib, before) / 1024, 1),
            "exit": proc.returncode, "culprit_named": bool(named),
            "victims_listed": len(named[0]["evidence"].get("affected_ranks", {})) if named else 0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100, help="size of the plain log in MB (default 100)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain = os.path.join(tmp, "job64.log")
        build(plain, args.mb)
        gz = plain + ".gz"
        with open(plain, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        rows = [run(plain), run(gz)]
    print(f"{'file':<14} {'MB':>7} {'lines':>9} {'seconds':>8} {'peak RSS MiB':>13} {'culprit named':>14} {'victims':>8}")
    for r in rows:
        print(f"{r['file']:<14} {r['bytes'] / 1e6:>7.1f} {r['lines']:>9} {r['seconds']:>8} {r['peak_rss_mib']:>13} "
              f"{str(r['culprit_named']):>14} {r['victims_listed']:>8}")
    return 0 if all(r["culprit_named"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

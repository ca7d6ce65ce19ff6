"""The bare baseline for allreduce-bench: a plain torch.distributed timing loop, as a user writes it.

    torchrun --standalone --nproc_per_node=2 benchmarks/bare_allreduce_sweep.py 1048576 4194304

Per size: warm-up, then `iters` calls timed as one loop and divided (nccl-tests' way), the
slowest rank's average taken. Rank 0 prints one JSON line: {size: busbw_gbps}.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

WARMUP, ITERS = 5, 20


def main() -> None:
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    out = {}
    for size in (int(s) for s in sys.argv[1:]):
        buf = torch.zeros(size // 4, dtype=torch.float32)
        for _ in range(WARMUP):
            dist.all_reduce(buf)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(ITERS):
            dist.all_reduce(buf)
        mean = torch.tensor([(time.perf_counter() - t0) / ITERS], dtype=torch.float64)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        out[size] = size / float(mean) / 1e9 * 2 * (n - 1) / n
    if dist.get_rank() == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

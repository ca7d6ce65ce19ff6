"""A training script's start, with `ddpdoctor.watch()` before init_process_group, as a user writes it.

`--case noshow`: the last rank never calls init_process_group (stuck in its own code first).
`--case healthy`: every rank initialises.
"""

from __future__ import annotations

import argparse
import os
import time

import ddpdoctor

parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=("healthy", "noshow"))
parser.add_argument("--json", required=True)
args = parser.parse_args()
ddpdoctor.watch(timeout_s=8.0, json_path=args.json, on_hang="exit")

import torch.distributed as dist  # noqa: E402  (after watch(), as the docs show)

if args.case == "noshow" and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    time.sleep(3600)  # e.g. loading a dataset from a dead file system
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()

"""The baseline: what a bare torchrun script pays to init and all-reduce once.

Run as `torchrun --standalone --nproc_per_node=N benchmarks/bare_allreduce.py`.
"""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
assert tensor.item() == dist.get_world_size()
dist.destroy_process_group()

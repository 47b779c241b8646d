"""torchtitan's own trainer, unmodified, on a tide process group (GPUs, torch 2.15):

    torchrun --nproc-per-node 8 examples/torchtitan_on_tide.py <torchtitan.train's own arguments>

torchtitan calls init_process_group only when no group exists yet (torchtitan/distributed/
utils.py: "Skipping init_distributed"), so the group made here, with the tide backend,
is the one its FSDP2 recipe (apply_fsdp_to_decoder) shards over, and `import tide` fits
TIDE into FSDP2. Nothing of torchtitan is changed. Written for GPU nodes and not yet run on
one (docs/status.md); on CPUs torchtitan's models need flex attention's backward, which CPUs
lack (tests/python/test_real_models.py runs its recipe with only that kernel replaced).
"""
import os
import runpy
import sys

import torch
import torch.distributed as dist

import tide  # noqa: F401  registers the "tide" backend and fits TIDE into FSDP2

if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("tide")
sys.argv = ["torchtitan.train", *sys.argv[1:]]
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)

"""Registers ProcessGroupTide with torch.distributed as the "tide" backend."""
from __future__ import annotations

import torch.distributed as dist

from . import _C

BACKEND_NAME = "tide"


def _create_backend(dist_opts, backend_opts):
    # extended_api=True: torch hands us its DistributedBackendOptions (store, ranks,
    # timeout and group name) and the backend options object, which tide does not use.
    return _C.ProcessGroupTide(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.timeout,
        str(dist_opts.group_id),
    )


def register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )

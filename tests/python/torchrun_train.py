"""One rank of `torchrun --nnodes N ... torchrun_train.py OUT [MODE]`, as a user runs it: the
process group from torchrun's environment (`init_process_group("tide")`, no TIDE_* variable),
FSDP2's `fully_shard` unchanged (test_fsdp_zero_copy.train_worker). Writes what the tests
check to OUT/rank<r>.pkl.

MODE "train" (default): three steps of FSDP2 with TIDE-AG / TIDE-RS across the hosts.
MODE "die" / "hang": the last host's ranks SIGKILL / SIGSTOP themselves in the middle of the
second step's backward; every other rank records the error it got and how long it took (the
group's timeout: PG_TIMEOUT_S, default torch's 600 s).
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import tide  # noqa: F401  registers the backend, fits TIDE into FSDP2


def train_until_a_host_fails(rank, ws, local, sig):
    """FSDP2 steps in which the last host's ranks send themselves `sig` in the second step's
    backward, between the two layers' reduce-scatters (TIDE-RS across nodes); the others
    record what they got and how long it took."""
    from torch.distributed.fsdp import fully_shard

    from test_fsdp_zero_copy import AwkwardModel, batch, loss_of

    dying = rank >= ws - local

    class DieInBackward(torch.autograd.Function):
        step = 0

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if dying and DieInBackward.step == 1:
                os.kill(os.getpid(), sig)
            return grad

    torch.manual_seed(0)
    model = AwkwardModel()
    for layer in model.llama.layers:
        fully_shard(layer)
    fully_shard(model)
    model.llama.layers[0].register_forward_hook(lambda module, args, out: DieInBackward.apply(out))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    start, error = time.monotonic(), None
    try:
        for step in range(3):
            DieInBackward.step = step
            start = time.monotonic()
            loss_of(model, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001  what a survivor sees is the result
        error = f"{type(e).__name__}: {e}"
    return dict(error=error, elapsed=time.monotonic() - start)


def main(out: str, mode: str) -> None:
    dist.init_process_group("tide", timeout=timedelta(seconds=float(os.environ.get("PG_TIMEOUT_S", "600"))))
    rank, ws = dist.get_rank(), dist.get_world_size()
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    result = dict(host=socket.gethostname(), num_nodes=backend.num_nodes(),
                  engine=backend.inter_node_engine(), local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
                  tide_env=sorted(k for k in os.environ if k.startswith("TIDE_")))
    if mode == "train":
        from test_pseudo_nodes import _pseudo_node_train_worker

        # A marker in /dev/shm: each host's ranks must see their own host's markers only.
        open(f"/dev/shm/marker-of-rank-{rank}", "w").close()
        dist.barrier()
        result.update(_pseudo_node_train_worker(rank, ws))  # its "dev_shm": the listing after training
        dist.destroy_process_group()
    else:
        sig = {"die": signal.SIGKILL, "hang": signal.SIGSTOP}[mode]
        result.update(train_until_a_host_fails(rank, ws, result["local_world_size"], sig))
    with open(os.path.join(out, f"rank{rank}.pkl.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.rename(os.path.join(out, f"rank{rank}.pkl.tmp"), os.path.join(out, f"rank{rank}.pkl"))
    if mode != "train":
        os._exit(0)  # a group with a dead peer cannot be torn down collectively


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "train")

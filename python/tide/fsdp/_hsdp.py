"""HSDP's replicate dimension of a reduce-scatter, as stock foreach_reduce runs it, for the
CPU and the CUDA TIDE-RS alike (the caller picks the streams)."""
from __future__ import annotations

from dataclasses import dataclass

from ._paths import debug


@dataclass
class Hsdp:
    """The replicate group as FSDP2 hands it to foreach_reduce (group None: plain FSDP)."""
    group: object
    op: object
    all_reduce_grads: bool
    partial_reduce_output: object  # the running sum of the steps without an all-reduce

    def running_sum(self, reduce_output):
        """Without an all-reduce this step, `reduce_output` joins the running sum, which is
        returned for FSDP2 to keep. Else the sum so far is added to `reduce_output`, which
        the all-reduce then takes, and None is returned."""
        partial = self.partial_reduce_output
        if not self.all_reduce_grads:
            if partial is None:
                return reduce_output
            partial += reduce_output
            return partial
        if partial is not None:
            reduce_output += partial
        return None

    def all_reduce(self, reduce_output) -> None:
        """Over the replicate group, on the current stream (on a tide group: gloo, the
        inter-node engine of the CPU path, or NCCL, the CUDA delegate)."""
        import torch.distributed as dist

        dist.all_reduce(reduce_output, group=self.group, op=self.op)
        debug(f"reduce-scatter: HSDP all-reduce over the {self.group.size()}-rank replicate group")

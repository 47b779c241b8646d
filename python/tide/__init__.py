"""TIDE: zero-copy collectives for PyTorch FSDP2.

``import tide`` registers the ``tide`` process-group backend, so that
``torch.distributed.init_process_group("tide")`` (or ``"cpu:tide"``) works unchanged.
"""
from __future__ import annotations

import os

import torch  # loads libtorch / libc10, which tide._C links against


def _extend_path_to_extension() -> None:
    """An installed tide has tide._C beside this file. In a source tree every torch version
    has its own build directory (build/torch-<version>, see scripts/env): the running torch
    loads the extension built against it, or TIDE_BUILD's."""
    here = os.path.dirname(os.path.abspath(__file__))
    if any(name.startswith("_C.") and name.endswith(".so") for name in os.listdir(here)):
        return
    build = os.environ.get("TIDE_BUILD") or os.path.join(
        here, "..", "..", "build", "torch-" + torch.__version__.split("+")[0])
    __path__.append(os.path.join(build, "python", "tide"))


_extend_path_to_extension()

from . import _C, fsdp  # noqa: E402
from ._backend import BACKEND_NAME, register as _register

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "reduce_scatter_tensor_mixed"]

_register()
fsdp.install()  # FSDP2 takes the zero-copy path on tide groups (TIDE_FSDP=0: off)


def reduce_scatter_tensor_mixed(output, input, op=None, group=None, async_op=False):
    """Reduce-scatters bf16/fp16 ``input`` into an fp32 ``output`` (fp32 accumulation).

    The mixed-precision mode NCCL does not offer. With a ``tide`` group this is the
    ordinary ``reduce_scatter_tensor`` call: the backend accepts the dtype pair.
    """
    import torch.distributed as dist

    from ._backend import c10d_function

    return c10d_function("reduce_scatter_tensor")(
        output, input, op=op if op is not None else dist.ReduceOp.SUM, group=group,
        async_op=async_op,
    )

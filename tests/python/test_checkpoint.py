"""Distributed checkpoints (torch.distributed.checkpoint) of FSDP2 on tide groups, with a
transformers Llama and AdamW: save, load and resume through get_model_state_dict /
get_optimizer_state_dict / set_*_state_dict, a full-state-dict export, loading with
broadcast_from_rank0, and a restart at another world size (4 -> 3) from meta-device init.

A resumed run at the same world size equals the uninterrupted one bit for bit; after the
restart at 3 ranks the full state equals what was saved at 4, bit for bit, and training on
equals stock FSDP2 on gloo resumed from the same checkpoint (its reduce-scatter adding in
rank order, as TIDE's does: at 3 ranks gloo's own order differs)."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from real_models import (ADAMW_LR, assert_params_equal, assert_tide_ran_everywhere, full_params, hf_model,
                         hf_step, shard_decoder, tide_paths)


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _full_state(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _sharded_model(ws, meta, rank_order_rs=False):
    """The Llama under FSDP2 on this group; meta: built on the meta device, materialised
    with to_empty and initialised after sharding (every value is then loaded)."""
    from torch.distributed.device_mesh import init_device_mesh

    model = hf_model("llama", tied=True, meta=meta)
    shard_decoder(model, init_device_mesh("cpu", (ws,)))
    if meta:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)  # garbage the load must overwrite
            # Buffers no state dict holds (the rotary embedding's inv_freq) are the model's
            # to initialise after to_empty, as with any meta-device init.
            fresh = dict(hf_model("llama", tied=True).named_buffers())
            for name, buf in model.named_buffers():
                buf.copy_(fresh[name])
    if rank_order_rs:
        from test_pseudo_nodes import documented_order_reduce_scatter

        for m in model.modules():
            if hasattr(m, "set_custom_reduce_scatter"):
                m.set_custom_reduce_scatter(documented_order_reduce_scatter(ws))
    return model


def save_worker(rank, ws, path, steps_before, steps_after):
    """Trains, saves a checkpoint (and exports the full state on rank 0), trains on."""
    import torch.distributed.checkpoint as dcp

    model = _sharded_model(ws, meta=False)
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    for step in range(steps_before):
        hf_step(model, opt, step, rank, clip=None)
    dcp.save(_state(model, opt), checkpoint_id=path)
    full = _full_state(model)
    losses = [hf_step(model, opt, steps_before + s, rank, clip=None) for s in range(steps_after)]
    return dict(full=full if rank == 0 else None, losses=losses, params=full_params(model), paths=tide_paths())


def resume_worker(rank, ws, path, first_step, steps, zero_copy=True, rank_order_rs=False):
    """Builds the model on the meta device at this world size, loads the checkpoint, returns
    the full state right after the load, then trains on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    import tide.fsdp

    if not zero_copy:
        tide.fsdp.uninstall()
    model = _sharded_model(ws, meta=True, rank_order_rs=rank_order_rs)
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    state = _state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = _full_state(model)
    losses = [hf_step(model, opt, first_step + s, rank, clip=None) for s in range(steps)]
    return dict(loaded=loaded if rank == 0 else None, losses=losses, params=full_params(model), paths=tide_paths())


def broadcast_load_worker(rank, ws, full):
    """Only rank 0 holds the full state dict; set_model_state_dict broadcasts it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = _sharded_model(ws, meta=True)
    set_model_state_dict(model, full if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    loaded = _full_state(model)  # collective: every rank gathers
    return dict(loaded=loaded if rank == 0 else None)


def test_save_resume_reshard_and_broadcast(tmp_path):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(save_worker, 4, path, 2, 2, timeout=300)
    assert_tide_ran_everywhere(uninterrupted, groups=3)
    saved = uninterrupted[0]["full"]

    # Same world size, from meta-device init: the resumed steps equal the uninterrupted ones.
    resumed = run_ranks(resume_worker, 4, path, 2, 2, timeout=300)
    assert_tide_ran_everywhere(resumed, groups=3)
    assert_params_equal(resumed[0]["loaded"], saved, "loaded at 4 ranks")
    for r in range(4):
        assert resumed[r]["losses"] == uninterrupted[r]["losses"]
        assert_params_equal(resumed[r]["params"], uninterrupted[r]["params"], f"resumed at 4, rank {r}")

    # Another world size: 4 -> 3. The loaded state is the saved one; training on equals
    # stock FSDP2 on gloo resumed from the same checkpoint (reduce-scatter in rank order).
    at3 = run_ranks(resume_worker, 3, path, 2, 2, timeout=300)
    assert_tide_ran_everywhere(at3, groups=3)
    assert_params_equal(at3[0]["loaded"], saved, "loaded at 3 ranks")
    stock3 = run_ranks(resume_worker, 3, path, 2, 2, kwargs=dict(zero_copy=False, rank_order_rs=True),
                       backend="gloo", timeout=300)
    for r in range(3):
        assert at3[r]["losses"] == stock3[r]["losses"]
        assert_params_equal(at3[r]["params"], stock3[r]["params"], f"resumed at 3, rank {r}")

    # The full-state export loaded back with broadcast_from_rank0 (tide's broadcast).
    bcast = run_ranks(broadcast_load_worker, 3, saved, timeout=300)
    assert_params_equal(bcast[0]["loaded"], saved, "broadcast from rank 0")

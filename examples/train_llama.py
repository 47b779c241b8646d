"""FSDP2 on TIDE with a transformers Llama: the whole of what changes is `import tide` and
the backend's name. Copy it, change the model and the data.

    torchrun --standalone --nproc-per-node 2 examples/train_llama.py            # CPUs
    torchrun --standalone --nproc-per-node 8 examples/train_llama.py --cuda     # one GPU per rank

A small Llama built from a config (no download), one fully_shard per decoder layer then the
root, bf16 parameters with fp32 gradient reduction, activation checkpointing, AdamW,
clipping, and a distributed checkpoint at the end.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import tide  # noqa: F401  registers the "tide" backend and fits TIDE into FSDP2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true", help="one GPU per rank (LOCAL_RANK)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--checkpoint", default="", help="a directory to save a checkpoint in at the end")
    args = ap.parse_args()

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("tide")  # CPU and CUDA tensors alike
    rank, world = dist.get_rank(), dist.get_world_size()

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    model.gradient_checkpointing_enable()
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, config.vocab_size, (4, 128), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    if args.checkpoint:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=args.checkpoint)
    if rank == 0:
        print("tide paths:", dict(tide.fsdp.stats))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train a reference model on trajectory trees with data parallelism (DDP or FSDP2).

Launch (CPU, gloo; or CUDA, nccl: one process per GPU):

    python examples/train_distributed.py --make-data /tmp/trees.jsonl --num-trees 64
    torchrun --nproc-per-node 2 examples/train_distributed.py --data /tmp/trees.jsonl \
        --config tiny --wrap fsdp --normalize path_mean --trees-per-step 8 --steps 20

Data: JSONL, one trajectory (path) per line: ``{"tree_id": ..., "input_ids": [...]}`` with optional
``"loss_mask"`` (0/1 per token) and ``"weight"`` (path weight); lines sharing a ``tree_id`` form one
tree (``treecompile.runtime.data.read_trajectories``, which names the file and line of any bad
input).  Every rank reads the whole file; :class:`TreeSampler` draws the same global steps on every rank and
:func:`rank_batches` deals each step's trees (or packed partitions, ``--capacity``) to ranks by computed
tokens, with the *global* normalization of the step and weights times the world size (DDP/FSDP average
gradients).

Wrapping order (``--wrap``):
- ``ddp``: ``tmodel = treecompile.compile(model)`` on the device, then ``DDP(tmodel)``.
- ``fsdp``: ``tmodel = treecompile.compile(model)``, then ``fully_shard(tmodel)`` (root only).
- ``fsdp_layer``: ``fully_shard`` every decoder layer, then the root (:func:`fully_shard_tree_model`):
  the rewritten graph is split per layer and each layer's part runs through the layer's own call, so
  FSDP2 gathers one layer at a time, as for an ordinary model.
On CUDA the TreeModel torch.compiles its graph itself (inside the DDP/FSDP wrapper; per layer with
``fsdp_layer``).  ``--pad-to L`` pads every batch to L tokens (one compiled shape; with
``--capacity L`` nothing is longer), else lengths fall into ``treecompile.bucket_length`` buckets.

``--baseline per_path`` trains the same data the usual way, each path alone through the model wrapped
in DDP (optionally ``torch.compile``d), with the same global loss: the throughput reference.
At the end rank 0 prints one JSON line with the figures (``RESULT {...}``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import time

import torch
import torch.distributed as dist

import treecompile
from treecompile import Tree
from treecompile.runtime.data import read_trajectories
from treecompile.models import DenseConfig, DenseForCausalLM
from treecompile.runtime.distributed import (TreeSampler, backward_step, deal, fully_shard_tree_model,
                                             global_loss, rank_batches)
from treecompile.runtime.normalization import GlobalNorm


# ------------------------------------------------------------------------------------------- data
def read_trees(path: str, vocab_size: int | None = None) -> list[Tree]:
    """The JSONL trajectory file (``treecompile.runtime.data`` format) -> trees, in file order."""
    return [t.tree for t in read_trajectories(path, vocab_size=vocab_size)]


def make_data(path: str, num_trees: int, vocab: int, seed: int, scale: int) -> None:
    """Synthetic agentic trees: a prompt, then turns that branch (parallel calls, retries)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for t in range(num_trees):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 16) * scale)]
            frontier = [prompt]
            for _depth in range(rng.randint(1, 3)):
                nxt = []
                for p in frontier:
                    for _ in range(rng.randint(1, 3)):
                        nxt.append(p + [rng.randrange(vocab) for _ in range(rng.randint(2, 12) * scale)])
                frontier = nxt
            for p in frontier:
                mask = [0] * len(prompt) + [1] * (len(p) - len(prompt))
                f.write(json.dumps({"tree_id": t, "input_ids": p, "loss_mask": mask}) + "\n")


# --------------------------------------------------------------------------------------- training
def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="JSONL of {tree_id, input_ids[, loss_mask, weight]}")
    ap.add_argument("--make-data", metavar="PATH", help="write a synthetic JSONL and exit")
    ap.add_argument("--num-trees", type=int, default=64)
    ap.add_argument("--data-scale", type=int, default=1, help="multiplies segment lengths of --make-data")
    ap.add_argument("--model", help="directory written by save_pretrained (else --config)")
    ap.add_argument("--config", default="tiny", choices=["tiny", "qwen3_0_6b", "qwen3_1_7b"])
    ap.add_argument("--wrap", default="ddp", choices=["ddp", "fsdp", "fsdp_layer"])
    ap.add_argument("--baseline", choices=["per_path"], help="train each path alone (DDP) instead of trees")
    ap.add_argument("--compile-baseline", action="store_true", help="torch.compile the per-path model")
    ap.add_argument("--normalize", default="sum", choices=list(treecompile.NORMALIZATIONS))
    ap.add_argument("--trees-per-step", type=int, default=8)
    ap.add_argument("--capacity", type=int, help="split trees larger than this into packed partitions")
    ap.add_argument("--batch-tokens", type=int, help="merge a rank's whole trees into batches of at most this "
                    "many tokens (default: --pad-to)")
    ap.add_argument("--pad-to", type=int, help="pad every tree batch to this many tokens (one compiled shape)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps (cycles through epochs)")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", help="directory for the trained model (rank 0, save_pretrained)")
    return ap.parse_args()


def setup():
    if "RANK" not in os.environ:  # plain `python`: a one-process group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    cuda = torch.cuda.is_available()
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", local) if cuda else torch.device("cpu")


def build_model(args, device) -> DenseForCausalLM:
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts them)
    if args.model:
        return DenseForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    cfg = getattr(DenseConfig, args.config)()
    return DenseForCausalLM(cfg).to(device=device, dtype=dtype)


def per_path_step(module, trees, norm, rank, world, seed, epoch, device) -> tuple[torch.Tensor, int]:
    """Baseline: this rank's paths (dealt by path tokens), one forward each, global weights."""
    costs = [t.num_path_tokens for t in trees]
    dealt = deal(costs, world, seed=seed, epoch=epoch)
    mine = [(t, p) for j in dealt[rank] for t in [trees[j]] for p in range(t.num_paths)]
    count = max(1, max(sum(trees[j].num_paths for j in d) for d in dealt))
    total = torch.zeros((), dtype=torch.float64, device=device)
    coefs = {id(t): norm.path_coefficients(t) for t, _ in mine}
    for k in range(count):
        last = k == count - 1
        ctx = module.no_sync() if not last else contextlib.nullcontext()
        with ctx:
            if k < len(mine):
                t, p = mine[k]
                s, e = int(t.path_offsets[p]), int(t.path_offsets[p + 1])
                ids = t.input_ids[t.path_index[s:e]].to(device)[None]
                mask = t.loss_mask[s:e].to(device=device, dtype=torch.float64)
                coef = float(coefs[id(t)][p])
            else:  # filler: same number of forwards on every rank, zero weight
                ids = torch.zeros((1, 2), dtype=torch.long, device=device)
                mask = torch.zeros(2, dtype=torch.float64, device=device)
                coef = 0.0
            logits = module(ids)[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            loss = -(coef * mask[1:] * lp.to(torch.float64)).sum()
            loss.backward()
            total += loss.detach()
    return total, sum(int(trees[j].num_path_tokens) for j in dealt[rank])


def main():
    args = parse_args()
    if args.make_data:
        make_data(args.make_data, args.num_trees, vocab=97 if args.config == "tiny" else 151936,
                  seed=args.seed, scale=args.data_scale)
        print(f"wrote {args.make_data}")
        return
    if not args.data:
        raise SystemExit("--data (or --make-data) is required")
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args, device)
    records = read_trees(args.data, vocab_size=model.config.vocab_size)
    if args.pad_to and not args.baseline:
        longest = max(t.num_tokens for t in records) if args.capacity is None else args.capacity
        if longest > args.pad_to:
            raise SystemExit(f"--pad-to {args.pad_to} is below the longest batch ({longest} tokens): "
                             "raise it or pass --capacity <= --pad-to")
    if args.baseline:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = torch.compile(model, dynamic=True) if args.compile_baseline else model
        module = DDP(net, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
        params = module
    else:
        tmodel = treecompile.compile(model)
        if args.wrap == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            module = DDP(tmodel, device_ids=[device.index] if device.type == "cuda" else None,
                         broadcast_buffers=False)
        else:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (world,))
            layers = list(model.model.layers) if args.wrap == "fsdp_layer" else []
            module = fully_shard_tree_model(tmodel, layers=layers, mesh=mesh)
        params = tmodel
    opt = torch.optim.AdamW(params.parameters(), lr=args.lr)
    sampler = TreeSampler(len(records), trees_per_step=args.trees_per_step, seed=args.seed)

    step, epoch, timed = 0, 0, []
    while step < args.steps:
        sampler.set_epoch(epoch)
        for idx in sampler:
            if step >= args.steps:
                break
            trees = [records[i] for i in idx]
            norm = GlobalNorm.from_trees(trees, args.normalize, grad_scale=world)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if args.baseline:
                local, computed = per_path_step(module, trees, norm, rank, world, args.seed, epoch, device)
                loads = None
            else:
                batches, items, loads = rank_batches(trees, norm, rank=rank, world_size=world,
                                                     capacity=args.capacity, batch_tokens=args.batch_tokens or args.pad_to,
                                                     seed=args.seed, epoch=epoch, device=device)
                if args.pad_to:
                    batches = [b.padded(args.pad_to) for b in batches]
                local = backward_step(module, batches)
                computed = loads[rank]
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = global_loss(local.to(torch.float64), norm)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            path_tokens = sum(t.num_path_tokens for t in trees)
            unique = sum(t.num_tokens for t in trees)
            if step >= args.warmup:
                timed.append((dt, path_tokens, unique))
            if rank == 0:
                print(f"step {step:4d} epoch {epoch} loss {float(loss):.5f} {dt * 1e3:8.1f} ms "
                      f"trees {len(trees)} path tokens {path_tokens} unique {unique} "
                      f"loads {loads if loads is not None else computed}"
                      + (f" batches {len(batches)}" if not args.baseline else ""), flush=True)
            step += 1
        epoch += 1

    if rank == 0 and timed:
        T = sum(d for d, _, _ in timed)
        result = dict(mode=args.baseline or f"tree_{args.wrap}", world_size=world, device=str(device),
                      gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      torch=torch.__version__, dtype=args.dtype, config=args.config, normalize=args.normalize,
                      steps_timed=len(timed), mean_step_ms=1e3 * T / len(timed),
                      path_tokens_per_s=sum(p for _, p, _ in timed) / T,
                      unique_tokens_per_s=sum(u for _, _, u in timed) / T,
                      por=1 - sum(u for _, _, u in timed) / sum(p for _, p, _ in timed))
        print("RESULT " + json.dumps(result), flush=True)
    if args.save:
        sd = None
        if not args.baseline and args.wrap != "ddp":  # gather the shards (collective)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            if sd is not None:
                model = build_model(args, torch.device("cpu"))
                model.load_state_dict(sd)
            model.save_pretrained(args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

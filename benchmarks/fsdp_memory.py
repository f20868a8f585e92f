"""Peak memory per process of training a speculator, with and without FSDP (`--fsdp`), on CPU.

    python benchmarks/fsdp_memory.py --n-predict 1                                  # one process
    torchrun --nproc-per-node 2 benchmarks/fsdp_memory.py --n-predict 1 --fsdp      # sharded over two

Builds a random speculator of the given shape (default: ibm-fms/llama3-8b-accelerator's, emb 4096, inner 3072, vocab
128256, untied), shards it as the trainer's `--fsdp` does, and runs a few AdamW steps (forward, backward, update) on
random hidden states, as the trainer's steps are. Prints each process's peak resident memory (`ru_maxrss`), which
holds the weights, their gradients and AdamW's two moments (4 x 4 bytes per parameter unsharded), plus what a step
gathers. The base model, frozen, is not part of it.
"""

import argparse
import os
import resource

import torch
import torch.distributed as dist

from hf_mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel
from hf_mlp_speculator.training.sharding import shard


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emb-dim", type=int, default=4096)
    parser.add_argument("--inner-dim", type=int, default=3072)
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--n-predict", type=int, default=4)
    parser.add_argument("--tie-weights", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="shard across the processes (run under torchrun)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--positions", type=int, default=64, help="positions per step and process")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() // int(os.environ.get("WORLD_SIZE", 1))))
    if args.fsdp:
        dist.init_process_group("gloo")
    config = MLPSpeculatorConfig(emb_dim=args.emb_dim, inner_dim=args.inner_dim, vocab_size=args.vocab_size,
                                 n_predict=args.n_predict, tie_weights=args.tie_weights, scale_input=True)  # fmt: skip
    speculator = MLPSpeculatorPreTrainedModel(config).train()
    parameters = sum(p.numel() for p in speculator.parameters())
    if args.fsdp:
        speculator = shard(speculator)
    optimizer = torch.optim.AdamW(speculator.parameters(), lr=1e-4)
    for _ in range(args.steps):
        states = torch.randn(args.positions, 1, args.emb_dim)
        tokens = torch.randint(args.vocab_size, (args.positions, args.n_predict + 1))
        logits = speculator(states, tokens).logits  # [heads, positions, 1, vocab]
        labels = tokens[:, 1:].T[..., None]
        torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    rank, world = (dist.get_rank(), dist.get_world_size()) if args.fsdp else (0, 1)
    print(f"rank {rank} of {world}{' (FSDP)' if args.fsdp else ''}: {parameters / 1e9:.2f}B parameters, "
          f"peak RSS {peak:.1f} GiB")
    if args.fsdp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

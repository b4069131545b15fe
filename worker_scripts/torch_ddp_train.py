"""Data-parallel training of a small model with PyTorch's DistributedDataParallel:

- the process group comes from torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, with
  the backend cmlcluster chose (Gloo on CPUs, NCCL on GPUs, each process on its own GPU);
- a DistributedSampler gives each process its own share of the data, reshuffled every epoch;
- DDP starts every process from rank 0's parameters and averages gradients every step;
- only rank 0 writes checkpoints, and reports the loss (cmlcluster.report) to the session.

    %torchrun --nnodes 2 --nproc-per-node 2 worker_scripts/torch_ddp_train.py --epochs 5

Every process prints its rank and host, the result of one allreduce (the sum of all ranks),
the loss averaged over all processes each epoch, and at the end a checksum of its parameters:
the same on every rank, because every step applied the same averaged gradients.
"""

import argparse
import hashlib
import os
import socket
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from cmlcluster import report
from cmlcluster.pytorch import init_process_group

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--samples", type=int, default=4096)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--learning-rate", type=float, default=0.02)
parser.add_argument("--checkpoint-dir", help="keep rank 0's checkpoints here (default: a temporary folder, removed)")
args = parser.parse_args()

init_process_group()
rank, world_size = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
print(f"rank {rank} of {world_size} on {socket.gethostname()} ({device}, {dist.get_backend()})", flush=True)

# The collective everything below rests on: 0 + 1 + ... + (world_size - 1).
total = torch.tensor([float(rank)], device=device)
dist.all_reduce(total)
print(f"allreduce {total.item():g} expected {world_size * (world_size - 1) / 2:g}", flush=True)

# The same data on every process (same seed); the sampler gives each its share: y = x @ w + noise.
generator = torch.Generator().manual_seed(0)
x = torch.randn(args.samples, 8, generator=generator)
y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(args.samples, 1, generator=generator)
sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0)
loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, sampler=sampler)

torch.manual_seed(rank)  # a different start on every process: DDP replaces it with rank 0's
model = DistributedDataParallel(
    nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(device),
    device_ids=[device.index] if device.type == "cuda" else None,
)
optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
scratch = None if args.checkpoint_dir or rank != 0 else tempfile.TemporaryDirectory(prefix="torch-checkpoints-")
checkpoint_dir = args.checkpoint_dir or (scratch and scratch.name)  # a temporary one goes when the script ends
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    sums = torch.zeros(2, device=device)  # squared error, samples: this process's share
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        optimizer.step()
        sums += torch.stack([loss.detach() * len(xb), torch.tensor(float(len(xb)), device=device)])
    dist.all_reduce(sums)
    epoch_loss = (sums[0] / sums[1]).item()
    print(f"epoch {epoch + 1} loss {epoch_loss:.6f}", flush=True)
    if rank == 0:
        report(epoch + 1, args.epochs, loss=epoch_loss)
        os.makedirs(checkpoint_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(checkpoint_dir, f"epoch{epoch + 1}.pt"))

digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"parameters {digest[:16]}", flush=True)
dist.destroy_process_group()

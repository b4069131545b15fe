"""Data-parallel training of a small model with PyTorch's DistributedDataParallel:

- the process group comes from torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, with
  the backend cmlcluster chose (Gloo on CPUs, NCCL on GPUs, each process on its own GPU);
- a DistributedSampler gives each process its own share of the data, reshuffled every epoch;
- DDP starts every process from rank 0's parameters and averages gradients every step;
- a snapshot after every epoch, and training resumes from the newest one at the start (the
  pattern of PyTorch's DDP tutorial), so a run that lost a worker goes on where it was;
- only rank 0 reports the loss (cmlcluster.report) to the session.

    %torchrun --nnodes 2 --nproc-per-node 2 worker_scripts/torch_ddp_train.py --epochs 5
    %torchrun --nnodes 2 --max-restarts 1 worker_scripts/torch_ddp_train.py --epochs 50

Workers may share no disk: each node's local rank 0 writes the snapshot in the node's own folder
($CMLCLUSTER_CHECKPOINT_DIR, which cmlcluster gives each node for the run), and at the start the
rank holding the newest one sends it to all, so that a replaced node, even rank 0's, resumes from a
survivor's copy. With --checkpoint-dir, a folder every node sees, rank 0 alone writes it there.

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
parser.add_argument("--checkpoint-dir", help="a folder all nodes see, for rank 0's snapshot (default: each node's own)")
args = parser.parse_args()

init_process_group()
rank, world_size = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
print(f"rank {rank} of {world_size} on {socket.gethostname()} ({device}, {dist.get_backend()})", flush=True)

# The collective everything below rests on: 0 + 1 + ... + (world_size - 1).
total = torch.tensor([float(rank)], device=device)
dist.all_reduce(total)
print(f"allreduce {total.item():g} expected {world_size * (world_size - 1) / 2:g}", flush=True)

# Outside cmlcluster (plain torchrun), a temporary folder: no resuming after the script ends.
scratch = None if args.checkpoint_dir or "CMLCLUSTER_CHECKPOINT_DIR" in os.environ else tempfile.TemporaryDirectory()
checkpoint_dir = args.checkpoint_dir or os.environ.get("CMLCLUSTER_CHECKPOINT_DIR") or scratch.name
snapshot_path = os.path.join(checkpoint_dir, "snapshot.pt")
writes_snapshot = rank == 0 if args.checkpoint_dir else local_rank == 0  # one writer per folder


def save_snapshot(model: nn.Module, epochs_run: int) -> None:
    """This node's snapshot, replaced whole (a reader never sees half of one)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    part = f"{snapshot_path}.{os.getpid()}.part"
    torch.save({"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": epochs_run}, part)
    os.replace(part, snapshot_path)


def load_snapshot(model: nn.Module) -> int:
    """The epochs already run, with the model as it was then, from the newest snapshot any rank holds.

    Every rank takes part: the newest epoch is agreed on (all_reduce MAX), and the lowest rank
    holding it sends its snapshot to all (a replaced node has none of its own).
    """
    mine = torch.load(snapshot_path, map_location="cpu") if os.path.exists(snapshot_path) else {"EPOCHS_RUN": 0}
    newest = torch.tensor([mine["EPOCHS_RUN"]], device=device)
    dist.all_reduce(newest, op=dist.ReduceOp.MAX)
    if newest.item() == 0:
        return 0
    holder = torch.tensor([rank if mine["EPOCHS_RUN"] == newest.item() else world_size], device=device)
    dist.all_reduce(holder, op=dist.ReduceOp.MIN)
    box = [mine]
    dist.broadcast_object_list(box, src=int(holder.item()))
    model.load_state_dict(box[0]["MODEL_STATE"])
    print(f"resumed after epoch {box[0]['EPOCHS_RUN']} from rank {holder.item()}'s snapshot", flush=True)
    return int(box[0]["EPOCHS_RUN"])


# The same data on every process (same seed); the sampler gives each its share: y = x @ w + noise.
generator = torch.Generator().manual_seed(0)
x = torch.randn(args.samples, 8, generator=generator)
y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(args.samples, 1, generator=generator)
sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0)
loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, sampler=sampler)

torch.manual_seed(rank)  # a different start on every process: DDP replaces it with rank 0's
module = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
epochs_run = load_snapshot(module)
model = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
for epoch in range(epochs_run, args.epochs):
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
    if writes_snapshot:
        save_snapshot(model.module, epoch + 1)
    if rank == 0:
        report(epoch + 1, args.epochs, loss=epoch_loss)

digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"parameters {digest[:16]}", flush=True)
dist.destroy_process_group()

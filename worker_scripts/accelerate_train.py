"""Training with Hugging Face Accelerate, as its own examples do: an Accelerator, prepare() of the
model, optimizer and data loader (each process gets its share of the data, gradients are averaged),
accelerator.backward, and gather() of every process's loss.

    %accelerate --num-machines 2 worker_scripts/accelerate_train.py --epochs 5

The main process prints the gathered loss each epoch; every process prints its place (process index,
processes, the distributed type Accelerate chose) and host, and a checksum of its parameters at the
end: the same on every process.
"""

import argparse
import hashlib
import os
import socket
import time

import torch
from accelerate import Accelerator

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--epoch-seconds", type=float, default=0, help="each epoch takes at least this long")
options = parser.parse_args()

accelerator = Accelerator()
print(
    f"process {accelerator.process_index} of {accelerator.num_processes} on {socket.gethostname()} "
    f"{accelerator.distributed_type} precision {os.environ.get('ACCELERATE_MIXED_PRECISION')}",
    flush=True,
)
torch.manual_seed(0)
x = torch.randn(512, 8)
y = x @ torch.arange(1.0, 9.0).unsqueeze(1)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for epoch in range(options.epochs):
    total = torch.zeros(1, device=accelerator.device)
    for inputs, targets in data:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        total += loss.detach()
    losses = accelerator.gather(total / len(data))  # one value from every process
    if accelerator.is_main_process:
        print(f"epoch {epoch} loss {losses.mean().item():.4f} from {len(losses)} processes", flush=True)
    time.sleep(options.epoch_seconds)
weights = accelerator.unwrap_model(model).weight.detach().cpu().numpy().tobytes()
print(f"parameters {hashlib.sha256(weights).hexdigest()[:16]}", flush=True)

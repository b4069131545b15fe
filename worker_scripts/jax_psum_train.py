"""Data-parallel training of a linear model with JAX across processes, as written for Kubeflow's JAX
runtime: a plain ``jax.distributed.initialize()`` finds the run (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID), every process computes the gradient of its own share of the data,
and a psum across all processes' devices averages them each step.

    %jaxrun --nnodes 2 worker_scripts/jax_psum_train.py --steps 50

Every process prints its place and host, the psum of the process ids (1 + 2 + ... of all), its loss
each 10 steps, and a checksum of its parameters at the end: the same on every process.
"""

import argparse
import hashlib
import os
import socket

import jax
import jax.numpy as jnp
import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--fail-process", type=int, default=-1, help="this process raises at step 5")
options = parser.parse_args()

jax.distributed.initialize()
me, count = jax.process_index(), jax.process_count()
kubeflow = {name: os.environ.get(name) for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
print(f"process {me} of {count} on {socket.gethostname()} devices {jax.device_count()} env {kubeflow}", flush=True)

# One device of each process in the mesh's axis: psum sums across processes.
psum = jax.pmap(lambda x: jax.lax.psum(x, "p"), axis_name="p")
local = jax.local_device_count()
total = psum(jnp.full((local,), float(me + 1)))[0]
print(f"psum of process ids {float(total):.0f} expected {count * (count + 1) / 2 * local:.0f}", flush=True)

rng = np.random.default_rng(0)
x_all = rng.normal(size=(256, 4)).astype(np.float32)
y_all = x_all @ np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)
share = np.array_split(np.arange(len(x_all)), count)[me]  # this process's share of the data
x, y = jnp.asarray(x_all[share]), jnp.asarray(y_all[share])


def loss(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


@jax.pmap
def local_grad(w, x, y):
    return jax.grad(loss)(w, x, y)


average = jax.pmap(lambda g: jax.lax.psum(g, "p") / jax.lax.psum(1.0, "p"), axis_name="p")
w = jnp.zeros((local, 4))
xs, ys = jnp.stack([x] * local), jnp.stack([y] * local)
for step in range(options.steps):
    if step == 5 and me == options.fail_process:
        raise RuntimeError(f"process {me} failed on purpose at step {step}")
    w = w - 0.1 * average(local_grad(w, xs, ys))
    if step % 10 == 0 or step == options.steps - 1:
        print(f"step {step} loss {float(loss(w[0], x, y)):.6f}", flush=True)
print(f"parameters {hashlib.sha256(np.asarray(w[0]).tobytes()).hexdigest()[:16]}", flush=True)

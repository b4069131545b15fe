"""Horovod scripts for the tests: ranks that allreduce, for the tests of where ranks meet (interfaces, a
second network), each printing what it got and how it was reached; and ranks without a collective, for
the tests of how a run is started, stopped, failed or reused."""

# A rank that needs no collective: horovodrun's own rank variables, without `import horovod.tensorflow`,
# whose TensorFlow costs each rank 5 to 7 s of CPU on 2 cores. Such ranks are still horovodrun's, over the
# session's SSH to its workers; the collective itself is in every test below that allreduces.
RANK = 'import os\nrank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])\n'

# One allreduce; "rank R of N sum S rendezvous ADDR iface IFACE".
ALLREDUCE = """\
import os
import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum)
print(f"rank {hvd.rank()} of {hvd.size()} sum {float(total[0]):g} "
      f"rendezvous {os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']} iface {os.environ['HOROVOD_GLOO_IFACE']}", flush=True)
"""

# The same under hvd.elastic.run (an elastic run's driver and discovery); "rank R of N sum S rendezvous ADDR".
ELASTIC_ALLREDUCE = """\
import os
import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
state = hvd.elastic.TensorFlowState([tf.Variable(0.0)], rounds=0)


@hvd.elastic.run
def train(state):
    total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum)
    state.rounds += 1
    state.commit()
    print(f"rank {hvd.rank()} of {hvd.size()} sum {float(total[0]):g} "
          f"rendezvous {os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}", flush=True)


train(state)
"""

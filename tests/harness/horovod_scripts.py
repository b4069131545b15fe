"""Horovod training scripts for the tests of where ranks meet (interfaces, a second network): each rank
allreduces its rank + 1 and prints what it got and how it was reached."""

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

"""X-ray (cdsw.xray, %xray, the widget's button): where every rank of a running job is, right now,
without stopping anything.

A worker's agent gathers the Python stack of every thread of its program and of every Python
process below it (torchrun's, Horovod's, JAX's ranks; TensorFlow tasks run in the agent itself):
through the faulthandler dump each rank runner arms as it starts (hook.py), and with py-spy, where it
is installed and may attach, for the processes that armed none (launchers, other programs). The
session asks every running worker at once, on the engines' control channel, which a thread of the
agent serves while the program runs (gather.py, on the worker); report.py groups the ranks by
identical stack, names the odd ones out with their file:line and the collective the others wait in,
as text and as HTML.
"""

from .report import Frame, ProcessStacks, ThreadStack, XRay

__all__ = ["Frame", "ProcessStacks", "ThreadStack", "XRay"]

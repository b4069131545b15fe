"""What a session and its workers' agents agree on: the environment an agent starts with, and
the timings of the control plane between them. Both sides import this module, nothing else
of each other."""

from __future__ import annotations

# How an agent gets the controller's connection info: in this variable, or in a file that the
# other one names (a pod's mounted Secret: kubernetes/manifests.py).
CONNECTION_ENV = "CMLCLUSTER_CONNECTION"
CONNECTION_FILE_ENV = "CMLCLUSTER_CONNECTION_FILE"
ENGINE_ID_ENV = "CMLCLUSTER_ENGINE_ID"  # the engine id the agent registers as
PRELOAD_ENV = "CMLCLUSTER_PRELOAD"  # modules the agent imports while its engine registers
LOG_LEVEL_ENV = "CMLCLUSTER_LOG_LEVEL"  # the controller's and the agents' log level (WARN; DEBUG to look inside)
# CML's web-app ports, a worker's own (apps/ports.py): where it serves an app, read-only, and public.
APP_PORT_ENVS = ("CDSW_APP_PORT", "CDSW_READONLY_PORT", "CDSW_PUBLIC_PORT")
# Where a worker's address is not this machine's loopback: the port on that address at which its agent
# relays connections to 127.0.0.1:<CDSW_APP_PORT> (apps/forward.py); taken out of the program's environment.
APP_FORWARD_PORT_ENV = "CMLCLUSTER_APP_FORWARD_PORT"
# "1" when the worker's working folder is its own, removed when it ends: a stopped program names what it leaves.
OWN_FOLDER_ENV = "CMLCLUSTER_OWN_FOLDER"
# Its collect= paths, as JSON: they come home when it ends, so what it leaves is said without them.
COLLECT_ENV = "CMLCLUSTER_COLLECT"
# Names a 0600 JSON file of a Horovod run's env= that each rank reads (cmlcluster.horovod.rank): its
# values never travel on horovodrun's or ssh's command line.
RANK_ENV_FILE_ENV = "CMLCLUSTER_RANK_ENV"
# The session's silence_timeout, in seconds: how long an agent goes without the controller's pings
# before it takes the session to be gone and ends its worker (agent_engine's watchdog).
SILENCE_ENV = "CMLCLUSTER_SILENCE_TIMEOUT"
# Sized for real networks (a switch's failover, a Wi-Fi roam, a VPN's reconnect take seconds to tens
# of seconds); a backend declares its own (Capabilities.silence_timeout), local workers a short one.
DEFAULT_SILENCE_TIMEOUT = 60.0
# What an agent exits with when its watchdog ended the worker: the session names the silence.
SILENCE_EXIT = 70
# A worker on the session's own machine holds a lifeline: the read end of a pipe whose only write end the
# session process holds, at the descriptor this variable names. When the session's process ends, however
# it ends (kill -9 included), the pipe reads end-of-file and the agent ends its worker at once, instead
# of after silence_timeout (backends/local.py; agent/engine.py).
LIFELINE_FD_ENV = "CMLCLUSTER_LIFELINE_FD"

# An X-ray (cmlcluster/stacks): the session's request on each engine's control channel, and the agent's reply
# (the stacks of its program and of every rank below it).
XRAY_REQUEST = "cmlcluster_xray_request"
XRAY_REPLY = "cmlcluster_xray_reply"
# "0" in a process's environment (a run's env=): an X-ray never attaches py-spy to it (py-spy stops a process
# for the instant it reads it); one that armed no faulthandler dump (stacks/hook.py) is then named, not read.
PY_SPY_ENV = "CMLCLUSTER_PY_SPY"

# The controller's ping period. ipyparallel's hub announces a new engine at the beat after the first
# ping it answered, 1 to 2 periods after it connects: at 1000 ms that was most of a worker's start
# (the session's controller pings and announces sooner: ipyparallel_internals.announce_new_hearts_at_once).
HEARTBEAT_MS = 250
# The session starts its controller and its first workers at once: an engine may wait for the
# controller to listen for as long as the session waits for it.
CONTROLLER_START_TIMEOUT = 60.0

# A worker's output as the session keeps it: its log keeps the last TAIL_BYTES / 2 to TAIL_BYTES
# (logfile.py), and an SSH worker's relay on its host as much, for a connection that drops
# (ssh/relay.py); a pipe is read READ_CHUNK at a time on both sides.
TAIL_BYTES = 8 << 20
READ_CHUNK = 64 << 10

# What a worker uses (its process tree's CPU and memory, its GPUs): each agent samples it every
# USAGE_SECONDS (the worker's CMLCLUSTER_USAGE_SECONDS, settable through env=; 0 turns sampling off)
# and sends each sample as one iopub message of its own type and topic, beside the engine's output:
# never a line of the worker's output or of its kept log (usage.py).
USAGE_SECONDS_ENV = "CMLCLUSTER_USAGE_SECONDS"
DEFAULT_USAGE_SECONDS = 2.0
USAGE_MSG_TYPE = "cmlcluster_usage"
USAGE_TOPIC = b"cmlcluster.usage"

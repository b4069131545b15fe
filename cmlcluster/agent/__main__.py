"""`python -m cmlcluster.agent`: a worker's agent (main.py), or with --template a local backend's template."""

# The agent runs as the package's module, not as __main__: the session's calls (describe, run_program,
# unpack_files) import cmlcluster.agent.main, and the agent that runs must be that module, not a copy of it.
from cmlcluster.agent.main import run_as_process

run_as_process()

"""The agent: what runs inside every worker, beside the user's program (``python -m cmlcluster.agent``).

- ``main``: the agent's process: the worker's environment, its engine, and the functions the session calls
  in it by name (describe, run_program, call, unpack_files, leftovers)
- ``engine``: the worker's ipyparallel engine, with a watch on the controller that works while user code runs
- ``engine_imports``: what the engine leaves unimported as it starts, though ipyparallel would import it
- ``program``: the worker's program (a script, CML code, a function) run in its engine; its exit code
- ``files``: where shipped files are unpacked, and what a worker's own working folder was left holding
- ``template``: local workers forked from a template agent that imported the agent's modules once

Nothing here knows a session: what the agent needs comes in its environment (main's docstring).
"""

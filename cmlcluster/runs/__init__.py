"""What every framework's run shares: its options, the frame of a run, and the run of one node per worker.

- options.py: where and how a run's workers go (WorkerOptions), and the options of every magic and CLI verb
- skeleton.py: run(options, framework): the session, the view, the end report, check=; what a Framework supplies
- nodes.py: a framework of one node per worker (NodeFramework): shipping, the job, its nodes while they run
- node_process.py: a node's launcher on its worker: under a lifeline, stopped with it, its lines relayed
- result.py: what runs return and raise (RunResult, NodesResult, RankFailure, RunError)

Nothing is imported here: a worker's node imports node_process.py alone, none of the session's side.
"""

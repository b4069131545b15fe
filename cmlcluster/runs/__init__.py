"""What every framework's run shares, and the skeleton that runs one node per worker.

- options.py: where and how a run's workers go (WorkerOptions), and the options of every magic and CLI verb
- skeleton.py: run(options, framework): the session, shipping, the job, the nodes, the end report
- nodes.py: what a framework of one node per worker supplies (NodeFramework), and its nodes while they run
- node_process.py: a node's launcher on its worker: under a lifeline, stopped with it, its lines relayed
- result.py: what runs return and raise (RunResult, NodesResult, RankFailure, RunError)

Nothing is imported here: a worker's node imports node_process.py alone, none of the session's side.
"""

"""Workers: the code each of vLLM's worker processes runs, one per rank (vLLM's ``v1/worker``).

The ``--worker-cls`` that the front end selected (:mod:`.gpu_worker`, :mod:`.cpu_worker`: vLLM's workers with
:mod:`.worker`'s mixin) has vLLM allocate the KV cache in elastic spaces (:mod:`.allocation`) and serves this
rank's share of the pool (:mod:`.worker_pool`): the engine core's scheduler decides every map and unmap,
the worker executes them. Where a host arena is configured, the ``elastic`` sleep-mode backend
(:mod:`.sleep`) keeps asleep weights there. With vLLM's one-process executor (``UniProcExecutor``) the one
worker runs in the engine core's process.
"""

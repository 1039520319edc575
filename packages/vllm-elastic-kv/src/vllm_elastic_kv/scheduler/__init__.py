"""Engine core: the code vLLM's engine-core process runs, in and around its scheduler (vLLM's ``v1/core``).

``EngineCore`` builds the ``--scheduler-cls`` that the front end selected (:mod:`.scheduler`); while it
does, vLLM's own code builds the elastic KV cache manager (:mod:`.kv_cache_manager`) and block pool
(:mod:`.block_pool`). The scheduler owns the pool's ledger (:mod:`.scheduler_pool`), vacates the pages a
lowered limit releases (:mod:`.drain`), ends the requests that cannot fit under the pool's ceiling
(:mod:`.fit`) and applies ``kvctl``'s changes while the engine is idle (:mod:`.idle`). With vLLM's
one-process executor (``UniProcExecutor``) the worker runs in this process too.
"""

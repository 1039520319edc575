"""Front end: the code that runs in the process the user starts (``vllm serve``'s API server, ``LLM``,
``AsyncLLM``), before any engine process exists.

:mod:`.cli` adds ``--kv-cache-backend`` to vLLM's argument parser and checks the plugin's settings;
:mod:`.activation` turns ``kv_cache_backend=elastic`` into the ``--scheduler-cls`` / ``--worker-cls`` that
the engine core and the workers run (:mod:`vllm_elastic_kv.scheduler`, :mod:`vllm_elastic_kv.worker`); at
the front end's exit, :mod:`.exits` removes what the engine's processes, killed by vLLM, left behind.
"""

"""elastic-kv serve: many models on one device behind one OpenAI endpoint.

Engines (vLLM, SGLang) run as child processes with ``--kv-cache-backend=elastic``; a supervisor starts,
restarts, sleeps and wakes them within one device budget, and a FastAPI router forwards each request to its
model's engine. Entry point: the ``elastic-kv`` console script (:mod:`elastic_kv_serve.cli`).
"""

__version__ = "0.1.0"

"""vLLM's CPU worker, elastic KV cache: the front end selects it as
``--worker-cls vllm_elastic_kv.worker.cpu_worker.ElasticCPUWorker``."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_elastic_kv.worker.worker import ElasticWorkerMixin

__all__ = ["ElasticCPUWorker"]


class ElasticCPUWorker(ElasticWorkerMixin, CPUWorker):
    """vLLM's ``CPUWorker``; the KV cache lives in host virtual memory backed page by page."""

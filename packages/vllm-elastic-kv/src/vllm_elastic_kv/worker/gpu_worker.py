"""vLLM's GPU worker, elastic KV cache: the front end selects it as
``--worker-cls vllm_elastic_kv.worker.gpu_worker.ElasticGPUWorker``."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from vllm_elastic_kv.worker.worker import ElasticWorkerMixin

__all__ = ["ElasticGPUWorker"]


class ElasticGPUWorker(ElasticWorkerMixin, Worker):
    """vLLM's GPU ``Worker``; the KV cache lives in reserved device virtual memory backed page by page
    (CUDA VMM through the data plane's driver backend)."""

"""The elastic KV allocators, one module per kind as in SGLang's ``mem_cache/allocator/``: :mod:`.base`
(what they share), :mod:`.token`, :mod:`.paged`, :mod:`.swa`, :mod:`.pure_swa` and :mod:`.composite`."""

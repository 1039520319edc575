"""The ledger: which KV blocks are live, and so which logical pages must be backed.

:class:`Ledger` issues block ids to an engine and decides, page by page, when physical memory is
needed. It is the single owner of "which page is backed": the data plane (through a
:class:`~elastic_kv.ledger.page_mapper.PageMapper`) only executes its decisions, and the shared record
(``elastic_kv.registry.PoolRecord``) is charged for every byte before it is backed.

Page life cycle (``UNMAPPED`` -> ``USED`` <-> ``RESERVE`` / ``PENDING`` -> ``UNMAPPED``)::

    UNMAPPED --map (sync) or map_async + collect--> RESERVE --alloc--> USED (>= 1 live block)
    USED --last block freed--> RESERVE (room under the cap)   | PENDING (defer_release) | UNMAPPED
    PENDING --release_through(epoch)--> RESERVE | UNMAPPED;   PENDING --alloc--> USED (reuse is safe:
    only *unmapping* must wait for the GPU, reusing a backed page never does)
    USED (draining) --last block freed--> WITHHELD (defer_release) | UNMAPPED
    WITHHELD --release_through(epoch)--> UNMAPPED

Limits: when the limit drops below what the pool holds, the reserve is unmapped at once and the ledger
chooses pages in use to *drain* (:meth:`Ledger.draining_pages`, :mod:`.drain`): enough of them that
releasing them gets the pool under the limit, in the engine's order of preference
(:attr:`Ledger.drain_order`: the fewest requests to preempt), else fewest live blocks first. A draining
page issues no block again, so the blocks freed on it -- by requests finishing, or by the engine
preempting (vLLM) or retracting (SGLang) the requests that hold them -- are not handed to other
requests, and the page is unmapped once empty. The pool is ``SHRINKING`` until its charge fits; the
first snapshot published after that says so, and a limit lifted or raised above the charge ends the
drain at once.

Allocation is page-affine so that few pages stay backed: a request is served first from pages that are
already backed and partly used (the smallest one that holds the whole run, else the one with the most
free blocks -- kvcached's rule), then from backed empty pages (pending release, then the pre-mapped
reserve), and only then by mapping new pages. Backed empty pages come after partly used ones because
taking a fresh page while a partial one has room would leave two pages half full instead of one full.

Modules: :class:`Ledger` (:mod:`.ledger`, the policy) holds one
:class:`~elastic_kv.ledger.page_book.PageBook` (:mod:`.page_book`: free blocks per page, page states,
O(1) best fit), one :class:`~elastic_kv.ledger.page_backing.PageBacking` (:mod:`.page_backing`: charging
the record and mapping, unmapping, background maps, what a data-plane failure means), one
:class:`~elastic_kv.ledger.release.PageRelease` (:mod:`.release`: what happens to pages that empty), one
:class:`~elastic_kv.ledger.drain.Drain` (:mod:`.drain`: the pages released to meet a lowered limit) and
one :class:`~elastic_kv.ledger.guard.PoolGuard` (:mod:`.guard`: owner thread, open/closed/inconsistent). The
physical accounting (limit, shared record, cached headroom) is :mod:`.physical`; the reserve's sizing
:mod:`.reserve`; the protocol through which pages are backed :mod:`.page_mapper`.

Epochs (``defer_release``): the engine calls :meth:`Ledger.advance_epoch` when it launches GPU
work and :meth:`Ledger.release_through` with that epoch once the work finished. A page emptied
while epoch ``e`` is current is unmapped only after ``release_through(e)``: GPU work queued before the free
may still read or write it (kvcached #463), and unmapping under a running kernel is a fault that kills
the CUDA context.

Threading: a pool has one owner thread, the engine's scheduling thread (vLLM's engine-core loop, SGLang's
scheduler); every method that changes the pool raises ``RuntimeError`` when called from another thread
(one ``get_ident()`` comparison, which is also the closed/inconsistent check: far cheaper than a lock on
a path that runs per scheduled request). :meth:`Ledger.bind_thread` hands the pool to another thread.
:meth:`Ledger.snapshot`, :meth:`Ledger.available_size` and the read-only properties may be called from
any thread: they only read (under the GIL), so a reader sees numbers at most one operation old.
``kvctl`` changes reach the pool through its shared record and are applied by :meth:`Ledger.maintain`,
on the owner thread. The data plane's background mapping thread never calls into Python; its results are
picked up by :meth:`Ledger.maintain` and :meth:`Ledger.alloc`.
"""

from elastic_kv.ledger.ledger import Ledger

__all__ = ["Ledger"]

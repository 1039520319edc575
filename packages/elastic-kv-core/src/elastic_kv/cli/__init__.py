"""The command line over a host's pools: ``kvctl`` (:mod:`.kvctl`), its live view (:mod:`.top`) and the
Prometheus exporter (:mod:`.metrics`). They read and steer pools only through the registry
(:mod:`elastic_kv.registry`); nothing below imports from here."""

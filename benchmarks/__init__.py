"""The dcpstore benchmark harness: ``python -m benchmarks [--quick]``.

Measures save and load of one sharded state dict through dcpstore, torch's own
writers/readers, s3torchconnector, multi-storage-client and the raw limit of each store,
against servers it starts on 127.0.0.1. See :mod:`benchmarks.cli` and
``docs/performance.md``.
"""

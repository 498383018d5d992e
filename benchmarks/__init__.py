"""The dcpstore benchmark harness: ``python -m benchmarks [--quick]``.

Measures save and load of one sharded state dict through dcpstore, torch's own
writers/readers, s3torchconnector, multi-storage-client and the raw limit of each store,
against servers it starts on 127.0.0.1. See :mod:`benchmarks.cli` and
``docs/performance.md``.

Modules, each importing only those above it (``tests/test_benchmarks.py`` checks that
there is no import cycle, lazy imports included):

- leaves: ``workload`` (the state), ``wire`` (request settings, TLS trust, MSC
  profiles), ``pagecache``, ``env`` (machine facts, versions, results folders);
- stores: ``servers`` (:class:`~benchmarks.servers.Stores` / ``StoreInfo``, the one
  store description every suite uses);
- systems: ``adapters`` (``System``, ``OpContext``, ``Operation``, label syntax), then
  ``limits`` and ``stall_systems`` on it, then ``systems`` (the DCP peers and the
  registry of every system); ``options`` (``--opt`` scoping), ``tuning``;
- harness core: ``ranks`` (rank processes), ``runner`` (interleaved runs), ``report``;
- suites: ``cli`` (the throughput run, ``python -m benchmarks``), ``curves``
  (``--curves``), ``stall``, ``cuda_stall``, ``incremental``, ``read_once``,
  ``request_cost``, ``scale``, ``memory_scaling``, ``process_ab``, ``wire_settings``.
"""

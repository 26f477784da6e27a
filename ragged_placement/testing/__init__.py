"""Instruments for the tests, the benchmarks, the examples and the trainer's log line; none of
the runtime imports them.

* :mod:`.launch`: :func:`~.launch.run_gloo`, a function on local gloo ranks (forked from a
  server that imported torch once), with a hang guard naming each blocked rank's c10d call.
* :mod:`.profiling`: meters that observe torch FSDP2 and this runtime the same way
  (collectives and bytes per mesh dim, layout copies, heap peak, allocations).
"""

"""spectrio.tools.measurement: what measures a runtime.

* ``spectrio bench``: :mod:`.bench` (its flags and the sweep over cases and rounds),
  :mod:`.bench_workload` (prompts, speculative configs, arrivals), :mod:`.bench_run` (a
  case's requests and figures), :mod:`.bench_report` (rows, table, memory floor),
  :mod:`.bench_speedup`, :mod:`.bench_prefix` (the prefix-cache workload) and
  :mod:`.bench_plot`;
* request traces (``docs/trace.md``): :mod:`.trace_format` (the format, reader and
  writer), :mod:`.trace_record` (results from deltas, ``serve --record``),
  :mod:`.trace_summary`, :mod:`.trace_command` (``spectrio trace``), :mod:`.replay` and
  :mod:`.diff`;
* :mod:`.latency`: the percentiles every measuring command prints.

Submodules are imported explicitly; this package exports no names of its own.
"""

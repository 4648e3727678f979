"""spectrio.tools: what users run, in three rooms.

* :mod:`spectrio.tools.cli`: the ``spectrio`` command (``main``), its shared flags and
  logging, and the commands that serve or convert: generate, serve, client, keys,
  convert, quantize;
* :mod:`spectrio.tools.training`: ``spectrio train`` (the bundled model) and
  ``spectrio train-mtp`` (an MTP head for a model that has none), with their corpus,
  tokenizer and chat prompts;
* :mod:`spectrio.tools.measurement`: ``spectrio bench``, request traces (``trace``,
  ``replay``, ``diff``) and the latency figures they share.

The served runtime's metrics (``ServeMetrics``, ``ObservedRuntime``) live beside the
servers, in :mod:`spectrio.runtime.metrics`. The modules' old flat paths
(``spectrio.tools.bench``...) still import, with a DeprecationWarning naming the new one.
"""

from spectrio._moved import moved_modules

# Old flat module -> its room (issue 59). A module split in parts maps to the part that
# kept its entry point or, for the trace format, its reader and writer.
MOVED = {
    "spectrio.tools.serve_cli": "spectrio.tools.cli.serve",
    "spectrio.tools.chat_flags": "spectrio.tools.cli.chat_flags",
    "spectrio.tools.sampling_flags": "spectrio.tools.cli.sampling_flags",
    "spectrio.tools.runtime_flags": "spectrio.tools.cli.runtime_flags",
    "spectrio.tools.logging_setup": "spectrio.tools.cli.logging_setup",
    "spectrio.tools.convert": "spectrio.tools.cli.convert",
    "spectrio.tools.quantize": "spectrio.tools.cli.quantize",
    "spectrio.tools.train": "spectrio.tools.training.train",
    "spectrio.tools.train_mtp": "spectrio.tools.training.train_mtp",
    "spectrio.tools.corpus": "spectrio.tools.training.corpus",
    "spectrio.tools.tokenizer_train": "spectrio.tools.training.tokenizer_train",
    "spectrio.tools.chat_prompts": "spectrio.tools.training.chat_prompts",
    "spectrio.tools.bench": "spectrio.tools.measurement.bench",
    "spectrio.tools.bench_plot": "spectrio.tools.measurement.bench_plot",
    "spectrio.tools.bench_prefix": "spectrio.tools.measurement.bench_prefix",
    "spectrio.tools.bench_speedup": "spectrio.tools.measurement.bench_speedup",
    "spectrio.tools.trace": "spectrio.tools.measurement.trace_format",
    "spectrio.tools.replay": "spectrio.tools.measurement.replay",
    "spectrio.tools.diff": "spectrio.tools.measurement.diff",
    "spectrio.tools.latency": "spectrio.tools.measurement.latency",
    "spectrio.tools.metrics": "spectrio.runtime.metrics",
}

# Modules that were split: the other new modules holding some of their names.
SPLIT = {
    "spectrio.tools.serve_cli": ("spectrio.tools.cli.serve_run", "spectrio.tools.cli.client"),
    "spectrio.tools.train": ("spectrio.tools.training.chain", "spectrio.tools.training.optim"),
    "spectrio.tools.train_mtp": (
        "spectrio.tools.training.mtp_generations",
        "spectrio.tools.training.mtp_features",
        "spectrio.tools.training.mtp_loop",
    ),
    "spectrio.tools.bench": (
        "spectrio.tools.measurement.bench_workload",
        "spectrio.tools.measurement.bench_run",
        "spectrio.tools.measurement.bench_report",
    ),
    "spectrio.tools.trace": (
        "spectrio.tools.measurement.trace_record",
        "spectrio.tools.measurement.trace_summary",
        "spectrio.tools.measurement.trace_command",
    ),
}
moved_modules(MOVED, SPLIT)

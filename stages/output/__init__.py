"""What turns a folded step into output: the publisher (:mod:`.publisher`), the step
record's packing (:mod:`.records`), and the output processor (:mod:`.output_processor`:
a request's text, logprobs and statistics, for streams, the wire client and the CLI)."""

"""spectrio.tools: corpus, tokenizer and model training, trace replay, benchmarks and the CLI."""

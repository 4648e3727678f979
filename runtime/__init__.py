"""spectrio.runtime: configuration, planning, channels, pipeline assembly and the public API."""

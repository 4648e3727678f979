"""spectrio.models (public names filled in below)."""

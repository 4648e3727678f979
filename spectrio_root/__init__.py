"""spectrio: an async actor-pipeline runtime for speculative decoding with MTP draft heads.

The top-level namespace is curated; each sub-package (``spectrio.models``,
``spectrio.runtime`` ...) lives in its own folder of the repository.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

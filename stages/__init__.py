"""spectrio.stages: one module per pipeline actor plus the pure logic each needs."""

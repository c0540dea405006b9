"""Training loops that run inside Ray workers, and the stage functions that launch them."""

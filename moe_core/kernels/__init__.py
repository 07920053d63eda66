"""Building blocks shared by the kernel backends."""

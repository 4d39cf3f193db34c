"""Planning before any GPU is rented: the stage split, its costs, per-rank memory and idle time, and whether a run fits."""

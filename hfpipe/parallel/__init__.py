"""Processes and meshes: device and process groups, the local launcher, folder locks, signals, errors from workers."""

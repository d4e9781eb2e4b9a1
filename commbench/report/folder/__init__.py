"""I/O of a report folder: the folder claimed, files written atomically, read back checked."""

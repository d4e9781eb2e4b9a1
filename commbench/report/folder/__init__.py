"""I/O of a report folder: the folder claimed, files written atomically, read back typed and checked, and
rendered from its files (``writer.render_folder``)."""

"""Adapters that drive other libraries' MoE dispatchers (DeepEP, UCCL-EP, pplx-kernels, NCCL EP) as backends.

Each adapter is a small module that imports its library lazily (the library is needed only when the backend
is built or checked, never to import commbench), maps one rank's plan (its token rows, the top-k expert ids
and weights of its tokens) onto the library's dispatch and combine calls, and hands the received rows back in
commbench's order, so the same verification runs as for the built-in backends. ``common`` holds what they
share; docs/plugins.md lists the library version each follows and how each library defines bandwidth.
"""

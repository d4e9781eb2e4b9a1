"""Stage 5, run: jobs, the harness's timing loop, phases, rows, process groups and thread ranks.

``jobs`` declares what to run, ``placement`` gathers the layout, ``harness.run_jobs`` times every phase that
``phases`` defines (through the backend ``interface``), and ``rows`` turns bytes and times into result rows.
"""

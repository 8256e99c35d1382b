"""The gateway's router: which scheduler worker runs each request (`router.py`), from an index of the
blocks every worker's prefix cache holds, built from the workers' own events (`kv_index.py`), and
their load; the policies by name (`policies.py`)."""

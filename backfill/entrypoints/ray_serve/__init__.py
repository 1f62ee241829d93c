"""`backfill serve --replicas N`: N engines on Ray Serve behind one OpenAI endpoint.

Ray is imported by launcher.py, ingress.py, muxes.py, engine_replica.py and router.py only;
options.py (the flags, which the single-process server parses too), policy.py, prefix_index.py,
metrics_merge.py, asgi_call.py and mux.py do without it.
"""

"""`backfill serve --replicas N`: N engines on Ray Serve behind one OpenAI endpoint.

Only options.py, prefix_index.py and asgi_call.py may be imported without Ray installed (the
single-process server imports options.py for its flags); the rest imports Ray.
"""

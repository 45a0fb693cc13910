"""dsakv.serve: the OpenAI-compatible HTTP server over a GenerationBackend (colocated Engine or disagg router).

Layering: serve imports engine (and disagg only through the backend protocol); cli imports serve.
"""

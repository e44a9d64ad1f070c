"""The OpenAI-compatible gateway in front of the data pool.

``app.create_app`` builds the FastAPI app (routes, auth, recording), ``server`` runs it under uvicorn,
``upstreams`` is where samples come from, ``chat`` renders messages prefix-consistently, ``ui`` is the inspection UI.
Import from the modules: importing this package stays cheap.
"""

"""OpenAI-compatible transcription server over the package's public API (see README "Serving").

`python -m nxdi_voxtral serve`: app.py (HTTP: routes, errors, admission, streaming), host.py (the device thread,
versions, hot swap, rank-worker recovery), metrics.py (Prometheus), cli.py (arguments, signals, uvicorn).
"""

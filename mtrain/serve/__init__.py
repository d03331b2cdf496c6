"""`mtrain serve`: a trained model behind a local HTTP API and a page that shows it working.

`api` reads requests, `batcher` decodes concurrent ones together, `service` holds the model,
`explain` turns a search's record into JSON, `app` routes HTTP, `edge` says who may ask,
`server` runs it within its connection limits until a signal.

Stage 8: it imports only from the stages before it (the model is loaded through `run` and
wrapped by `decoding` or `export`).
"""

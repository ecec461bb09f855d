"""The router's HTTP/JSON front and what only it needs: the `Idempotency-Key` header's parser
(`idempotency_header.py`), JSON to request messages (`json_mapping.py`), our answers as problem
details (`problems.py`), the OpenAPI document (`openapi.py`), and the ASGI application itself
(`front.py`), served by uvicorn on the router's event loop."""

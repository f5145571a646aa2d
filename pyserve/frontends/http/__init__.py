"""The HTTP/REST frontend (KServe v2 + Triton's extensions): Starlette routes, served by pyserve's
own HTTP/1.1 server (``pyserve.frontends.http.server``) or uvicorn."""

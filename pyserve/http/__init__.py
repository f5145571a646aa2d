"""The HTTP/REST frontend (KServe v2 + Triton's extensions) on Starlette and uvicorn."""
